"""The README is a first page a newcomer reads in five minutes, and every relative link of the docs holds.

- the README's English part (everything before its Japanese section) is at most ``MAX_WORDS`` words;
- every relative link in README.md, CONTRIBUTING.md and docs/*.md names a file that exists, and an anchor
  (``#...``) names a heading of the target (GitHub's slugs), or an explicit ``<a id>`` in it.
"""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_WORDS = 1500
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def english_part(text: str) -> str:
    return text.split("\n## 日本語", 1)[0]


def words(text: str) -> int:
    return len(FENCE.sub(" ", text).split())


def test_the_readme_english_part_is_short():
    count = words(english_part((ROOT / "README.md").read_text(encoding="utf-8")))
    assert count <= MAX_WORDS, (
        f"README.md's English part has {count} words (at most {MAX_WORDS}): move detail to docs/"
    )


def test_the_word_count_sees_a_long_readme():
    assert words("# T\n" + "word " * (MAX_WORDS + 1)) > MAX_WORDS
    assert words("a b\n```bash\nmake test lots of code words\n```\nc") == 3  # code does not count


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*?|_", "", heading.strip().lower())
    kept = "".join(
        ch
        for ch in text
        if ch in " -_" or unicodedata.category(ch)[0] in "LN"  # letters, digits (any script)
    )
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    return found


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [a or b for a, b in LINK.findall(text)]


def broken(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not checked (offline)
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
        if not dest.exists():
            bad.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {shown}")
    return bad


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_holds(path):
    assert broken(path) == []


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Using a GPU\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#using-a-gpu) [gone](missing.md) [no anchor](other.md#nowhere) "
        "![pic](img.png) [web](https://example.org) `[code](nothing.md)`\n"
    )
    assert [b.split(":")[0] for b in broken(page)] == ["missing.md", "other.md#nowhere", "img.png"]
    assert slug("Set-up: two commands") == "set-up-two-commands"
    assert (
        slug("The embedded default, and switching to the hub")
        == "the-embedded-default-and-switching-to-the-hub"
    )
    assert slug("日本語") == "日本語"
