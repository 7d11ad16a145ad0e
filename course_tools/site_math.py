"""A Markdown extension for the course site: ``$...$`` and ``$$...$$`` become MathML when the site is built.

The lessons write their formulas as Jupyter does (TeX between dollars). MathJax or KaTeX would be loaded
from a CDN, which the offline build and the offline site cannot reach, so the formulas are converted here,
at build time, by ``latex2mathml`` (pure Python), and the browser draws MathML itself (Chromium 109+).
Code spans are untouched: the backtick pattern runs before this one. mkdocs.yml loads it by module name.
"""

from __future__ import annotations

import html

from latex2mathml.converter import convert
from markdown import Extension
from markdown.inlinepatterns import InlineProcessor

DISPLAY = r"\$\$(?P<tex>.+?)\$\$"
# One dollar, not escaped, not empty, no space just inside, not followed by a digit ("$5 and $6").
INLINE = r"(?<![\\$])\$(?![\s$])(?P<tex>[^$\n]+?)(?<!\s)\$(?!\d)"


def to_mathml(tex: str, display: bool) -> str:
    """The MathML of ``tex``; TeX that latex2mathml cannot read stays visible as code, never dropped."""
    try:
        return convert(tex.strip(), display="block" if display else "inline")
    except Exception:  # latex2mathml raises many kinds of errors on TeX it does not know
        return f'<code class="tex">{html.escape(tex)}</code>'


class MathProcessor(InlineProcessor):
    def __init__(self, pattern: str, md, display: bool):
        super().__init__(pattern, md)
        self.display = display

    def handleMatch(self, m, data):  # noqa: N802 (Python-Markdown's name)
        return self.md.htmlStash.store(to_mathml(m.group("tex"), self.display)), m.start(0), m.end(0)


class MathExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Python-Markdown's name)
        # After backticks (190) and escapes (180): code spans keep their dollars.
        md.inlinePatterns.register(MathProcessor(DISPLAY, md, display=True), "course_math_display", 176)
        md.inlinePatterns.register(MathProcessor(INLINE, md, display=False), "course_math_inline", 175)


def makeExtension(**kwargs):  # noqa: N802 (the name Python-Markdown looks for)
    return MathExtension(**kwargs)
