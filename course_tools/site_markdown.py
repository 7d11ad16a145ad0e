"""Jupyter's Markdown as the site's Markdown (Python-Markdown, which MkDocs uses), and links across the site.

Two differences matter for the lessons: Jupyter (CommonMark) nests a list under an item by the item's
text indentation (``1. x`` then ``   - y``), Python-Markdown only by 4 spaces; and CommonMark starts a list
or a table right after a paragraph line, Python-Markdown needs a blank line first. ``jupyter_to_mkdocs``
rewrites both, outside fenced code, and leaves everything else as written.

``LinkMap`` turns a link written in the repository (``../docs/distributed.md``, ``02_distributed_concepts.ipynb``)
into the link to the same thing on the site; a link to a file the site does not publish keeps its text
and loses the link (listed in ``LinkMap.unlinked``), so no page links to nothing.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

MARKER = re.compile(r"^( *)([-*+]|\d{1,9}[.)])( +|$)")
FENCE = re.compile(r"^ *(`{3,}|~{3,})")
TABLE_ROW = re.compile(r"^ *\|")
LINK = re.compile(r"(?P<bang>!?)\[(?P<label>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")


def _shift(line: str, delta: int) -> str:
    if delta >= 0:
        return " " * delta + line
    drop = min(-delta, len(line) - len(line.lstrip(" ")))
    return line[drop:]


def jupyter_to_mkdocs(text: str) -> str:
    """Re-indent nested lists to 4 spaces a level; a blank line before a list or table that follows text."""
    out: list[str] = []
    items: list[tuple[int, int]] = []  # open list items: (marker indent, text indent), outermost first
    fence: tuple[str, int] | None = None  # (the fence that closes it, the shift its lines get)
    previous = "blank"
    for line in text.split("\n"):
        if fence is not None:
            out.append(_shift(line, fence[1]) if line.strip() else line)
            if line.strip().startswith(fence[0]) and not line.strip().strip(fence[0][0]):
                fence = None
            continue
        if not line.strip():
            out.append(line)
            previous = "blank"
            continue
        indent = len(line) - len(line.lstrip(" "))
        marker = MARKER.match(line)
        if marker and not (not items and indent >= 4):
            while items and indent < items[-1][1]:
                items.pop()
            level = len(items)
            if level == 0 and previous not in ("blank", "list"):
                out.append("")
            items.append((indent, indent + len(marker.group(2)) + max(1, len(marker.group(3)))))
            new_indent = 4 * level
            kind = "list"
        elif items and indent == 0:
            if previous == "blank":
                items = []  # the list has ended
            new_indent, kind = 0, ("list" if items else "text")
        elif items:
            depth = max((k for k, (_, text_at) in enumerate(items) if text_at <= indent), default=0)
            del items[depth + 1 :]
            new_indent = 4 * (depth + 1) + max(0, indent - items[depth][1])
            kind = "list"
        else:
            new_indent = indent
            kind = "table" if TABLE_ROW.match(line) else "text"
            if kind == "table" and previous not in ("blank", "table"):
                out.append("")
        delta = new_indent - indent
        out.append(_shift(line, delta))
        opened = FENCE.match(line)
        if opened:
            fence = (opened.group(1), delta)
        previous = kind
    return "\n".join(out)


def outside_fences(text: str, change) -> str:
    """``change`` applied to each line of ``text`` that is not inside fenced code."""
    out, fence = [], None
    for line in text.split("\n"):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            line = change(line)
        out.append(line)
    return "\n".join(out)


@dataclass
class LinkMap:
    """Repository paths the site publishes -> their site paths (``None``: the site's home, no anchor)."""

    pages: dict[str, str]
    home: set[str] = field(default_factory=set)  # repository files shown by the home page (README.md)
    unlinked: list[str] = field(default_factory=list)

    def target(self, source: str, page: str, target: str) -> str | None:
        """The link from site page ``page`` for ``target`` as written in repository file ``source``."""
        if target.startswith(EXTERNAL) or target.startswith("#"):
            return target
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if resolved in self.home:
            return posixpath.relpath("index.md", posixpath.dirname(page) or ".")
        if resolved not in self.pages:
            return None
        link = posixpath.relpath(self.pages[resolved], posixpath.dirname(page) or ".")
        return f"{link}#{anchor}" if anchor else link

    def rewrite(self, text: str, source: str, page: str) -> str:
        """Every Markdown link and image of ``text`` (from ``source``) as it must read on ``page``."""

        def one(match: re.Match) -> str:
            new = self.target(source, page, match["target"])
            if new is not None:
                return f"{match['bang']}[{match['label']}]({new}{match['title'] or ''})"
            self.unlinked.append(f"{source}: {match['target']}")
            return match["label"]

        return outside_fences(text, lambda line: LINK.sub(one, line))
