"""The static site's page making (course_tools.site_*), without MkDocs or a browser where it can.

The browser tier (tests/browser/test_site.py) builds the whole site and opens it; these are the pieces:
Jupyter's Markdown made readable by Python-Markdown, links rewritten to the site's pages, formulas as
MathML, and a notebook's committed outputs as a page.
"""

from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET

import pytest

from course_tools.site_markdown import LinkMap, jupyter_to_mkdocs
from course_tools.site_pages import notebook_markdown, terminal_text, title_of

PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
    )
).decode()


def test_nested_lists_get_four_spaces_a_level_and_a_blank_line_after_text():
    text = "Intro line\n1. first\n   - nested under first\n     continued\n2. second\nafter"
    assert jupyter_to_mkdocs(text) == (
        "Intro line\n\n1. first\n    - nested under first\n        continued\n2. second\nafter"
    )


def test_fenced_code_in_a_list_moves_with_its_item_and_top_level_fences_are_untouched():
    listed = "- item\n  ```python\n  x = 1\n  ```"
    assert jupyter_to_mkdocs(listed) == "- item\n    ```python\n    x = 1\n    ```"
    fence = "```text\n- not a list\n  - kept as written\n```"
    assert jupyter_to_mkdocs(fence) == fence


def test_a_table_after_text_gets_a_blank_line():
    assert (
        jupyter_to_mkdocs("Rows:\n| a | b |\n|---|---|\n| 1 | 2 |")
        == "Rows:\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    )


def test_links_point_to_the_site_pages_and_unpublished_files_become_text():
    links = LinkMap(
        pages={
            "notebooks/02_distributed_concepts.ipynb": "lessons/02_x.md",
            "docs/distributed.md": "docs/distributed.md",
        },
        home={"README.md"},
    )
    text = (
        "[guide](../docs/distributed.md#one-process) [lesson](02_distributed_concepts.ipynb) [readme](../README.md#tests) "
        "[code](../course_lib/data.py) [web](https://pytorch.org) [here](#top)\n```\n[kept](nowhere.md)\n```"
    )
    assert links.rewrite(text, "notebooks/01_device_placement.ipynb", "lessons/01_y.md") == (
        "[guide](../docs/distributed.md#one-process) [lesson](02_x.md) [readme](../index.md) "
        "code [web](https://pytorch.org) [here](#top)\n```\n[kept](nowhere.md)\n```"
    )
    assert links.unlinked == ["notebooks/01_device_placement.ipynb: ../course_lib/data.py"]


def test_a_notebook_page_shows_code_its_text_outputs_and_its_plot_as_a_file(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "# 09 テスト\n\n本文"},
            {
                "cell_type": "code",
                "source": "print('x')",
                "outputs": [
                    {
                        "output_type": "stream",
                        "name": "stdout",
                        "text": "step 1\rstep 2\n\x1b[31mred\x1b[0m\n",
                    },
                    {"output_type": "display_data", "data": {"image/png": PNG, "text/plain": "<Figure>"}},
                    {"output_type": "display_data", "data": {"text/plain": "(widget note)"}},
                ],
            },
        ]
    }
    links = LinkMap(pages={})
    page = notebook_markdown(nb, "notebooks/00_intro.ipynb", "lessons/09_t.md", tmp_path, links, "BOX")
    assert title_of(nb["cells"]) == "09 テスト"
    assert page.index("本文") < page.index("BOX") < page.index("```python\nprint('x')\n```")
    assert "step 2\nred" in page and "step 1" not in page and "\x1b" not in page
    assert "![コードセル 1 の図](img/09_t-001-1.png)" in page
    assert (tmp_path / "img" / "09_t-001-1.png").read_bytes() == base64.b64decode(PNG)
    assert "(widget note)" in page and "<Figure>" not in page


def test_terminal_text_keeps_what_was_drawn_last_on_each_line():
    assert terminal_text("10%\r50%\r100%\ndone\x1b[0m") == "100%\ndone"


def test_formulas_become_mathml_and_code_spans_keep_their_dollars():
    markdown = pytest.importorskip("markdown")
    pytest.importorskip("latex2mathml")
    html = markdown.markdown(
        "Cost $O(\\sqrt{n})$, code `$HOME`, price $5 and $6.\n\n$$L = \\sum_i \\frac{1}{k} L_i$$",
        extensions=["course_tools.site_math"],
    )
    maths = re.findall(r"<math.*?</math>", html, re.S)
    assert len(maths) == 2, html
    assert all(ET.fromstring(m).tag.endswith("math") for m in maths)
    assert 'display="block"' in maths[1] and 'display="block"' not in maths[0]
    assert "<code>$HOME</code>" in html and "$5 and $6" in html


def test_the_lesson_box_carries_the_english_summary_from_the_notebooks_metadata():
    from course_tools.site_pages import lesson_box

    box = lesson_box("03_mixed_precision.ipynb", [], "Mixed precision on your own machine.")
    assert '!!! note "English summary"' in box and "    Mixed precision on your own machine." in box
    assert "English summary" not in lesson_box("03_mixed_precision.ipynb", [])
