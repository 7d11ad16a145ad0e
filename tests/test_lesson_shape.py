"""The shape of a lesson as a learner meets it (../shared/COURSE.md, "The shape of a lesson").

1. A card on the first screen (cell 0, Japanese): the idea in one sentence, three objectives, what to
   have read first, minutes for the lesson and its exercise; the picture that carries the idea in the
   card or in the two cells after it. The English summary lives in ``metadata.summary``.
2. A main path (everything before the ``## 付録`` heading) of at most ``MAIN_PATH_PROSE`` characters of
   Markdown, with at least one figure.
3. Checked outputs are marked with nbval's ``nbval-check-output`` tag, never a comment in the code, and
   no fewer cells are checked than before the tag replaced the comment; the True/False verdict lines of
   the main path are printed by 確認 cells whose source is collapsed.
4. まとめ, then one clean script (the cell tagged ``lesson-script``; tests/test_lesson_scripts.py runs it),
   then the appendix; the run time and the machine report come last, out of the first screen.
"""

import re
from pathlib import Path

import nbformat
import pytest

from course_tools import nbtools

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Lessons whose main path is not yet cut to the appendix (issue 46, left for the next session): their
# shape tests are expected to fail until then, strictly, so that finishing one removes it from here.
MAIN_PATH_PENDING: set[str] = set()
PENDING = pytest.mark.xfail(reason="main path not yet restructured (issue 46)", strict=True)
SHAPED = [pytest.param(p, marks=PENDING) if p.name in MAIN_PATH_PENDING else p for p in LESSONS]
MAIN_PATH_PROSE = 9_000  # characters of Markdown before the appendix
CHECKED_CELLS_BEFORE_THE_TAG = 170  # cells marked `# NBVAL_CHECK_OUTPUT` when the tag replaced it
CHECK_TAG = "nbval-check-output"
SCRIPT_TAG = "lesson-script"
APPENDIX = re.compile(r"^## 付録", re.M)
VERDICT = re.compile(r"\b(True|False)\s*$", re.M)


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _appendix_index(nb) -> int:
    found = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and APPENDIX.search(c.source)]
    assert len(found) == 1, f"one markdown cell opens the appendix with '## 付録 ...' (found {len(found)})"
    return found[0]


def _has_figure(cell) -> bool:
    if cell.cell_type == "markdown":
        return bool(re.search(r"!\[[^\]]*\]\([^)]+\)|<img |<svg", cell.source))
    return any(
        "image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
        for o in cell.get("outputs", [])
    )


def _output_text(cell) -> str:
    texts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            texts.append("".join(out.get("text", "")))
        elif "text/plain" in out.get("data", {}) and "text/html" not in out.get("data", {}):
            texts.append("".join(out["data"]["text/plain"]))
    return "".join(texts)


def _hidden(cell) -> bool:
    return bool(cell.metadata.get("jupyter", {}).get("source_hidden"))


def test_no_fewer_outputs_are_checked_than_before_the_tag():
    tagged = sum(CHECK_TAG in c.metadata.get("tags", []) for p in LESSONS for c in _read(p).cells)
    assert tagged >= CHECKED_CELLS_BEFORE_THE_TAG, (
        f"{tagged} checked cells, fewer than {CHECKED_CELLS_BEFORE_THE_TAG}"
    )


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_checks_are_tags_not_comments(path):
    nb = _read(path)
    commented = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "NBVAL_CHECK_OUTPUT" in c.source
    ]
    assert not commented, f"cells {commented}: mark a checked cell with the '{CHECK_TAG}' tag, not a comment"
    assert any(CHECK_TAG in c.metadata.get("tags", []) for c in nb.cells), "deterministic cells are checked"
    for i, c in enumerate(nb.cells):
        if CHECK_TAG in c.metadata.get("tags", []):
            assert c.cell_type == "code", f"cell {i}: only a code cell's output can be checked"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_the_card_is_the_first_screen(path):
    nb = _read(path)
    summary = nb.metadata.get("summary", "")
    assert re.search(r"[A-Za-z]{4,}", summary) and len(summary) > 80, "metadata.summary: the English summary"
    card = nb.cells[0]
    assert card.cell_type == "markdown" and card.source.startswith("# "), (
        "cell 0 is the card, under the title"
    )
    text = card.source
    assert "**Summary.**" not in text and not re.search(r"[A-Za-z]{4,}(?: [A-Za-z]{3,}){6,}", text), (
        "the card is Japanese: the English summary belongs in metadata.summary"
    )
    idea = re.search(r"\*\*このレッスンの考え方\*\*[:：]\s*(.+)", text)
    assert idea and len(idea.group(1)) <= 200, "one sentence: **このレッスンの考え方**: ..."
    objectives = re.search(r"\*\*できるようになること\*\*\s*\n((?:\s*\d\. .+\n?)+)", text)
    assert objectives and len(re.findall(r"^\s*\d\. ", objectives.group(1), re.M)) == 3, (
        "three numbered objectives under **できるようになること**"
    )
    assert re.search(r"\*\*前提\*\*[:：]", text), "**前提**: what to have read first"
    assert re.search(r"\*\*所要時間\*\*[:：][^\n]*レッスン 約 \d+ 分[^\n]*演習 約 \d+ 分", text), (
        "**所要時間**: レッスン 約 N 分、演習 約 M 分"
    )
    assert any(_has_figure(c) for c in nb.cells[:3]), (
        "the picture that carries the idea: in the card or right after"
    )
    assert not any("format_machine(" in c.source for c in nb.cells[:3]), "the machine report goes to the end"


@pytest.mark.parametrize("path", SHAPED, ids=lambda p: p.name)
def test_a_short_main_path_then_summary_script_and_appendix(path):
    nb = _read(path)
    appendix = _appendix_index(nb)
    main = nb.cells[:appendix]
    prose = sum(len(c.source) for c in main if c.cell_type == "markdown")
    assert prose <= MAIN_PATH_PROSE, (
        f"{prose} characters of prose before the appendix (at most {MAIN_PATH_PROSE})"
    )
    assert any(_has_figure(c) for c in main[1:]), "the main path shows at least one figure"
    scripts = [i for i, c in enumerate(nb.cells) if SCRIPT_TAG in c.metadata.get("tags", [])]
    assert len(scripts) == 1 and scripts[0] < appendix, f"one '{SCRIPT_TAG}' cell, before the appendix"
    summary = [
        i for i, c in enumerate(main) if c.cell_type == "markdown" and re.match(r"#+ .*まとめ", c.source)
    ]
    assert summary and summary[-1] < scripts[0], "まとめ comes before the script"
    runtime = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and nbtools.RUNTIME_SENTENCE.search(c.source)
    ]
    assert runtime and runtime[0] > appendix, "the run time and machine report come at the end"


@pytest.mark.parametrize("path", SHAPED, ids=lambda p: p.name)
def test_verdicts_on_the_main_path_are_gathered_in_collapsed_check_cells(path):
    nb = _read(path)
    main = nb.cells[: _appendix_index(nb)]
    loose = [
        i
        for i, c in enumerate(main)
        if c.cell_type == "code" and not _hidden(c) and VERDICT.search(_output_text(c))
    ]
    assert not loose, (
        f"cells {loose} print True/False on the main path: gather verdicts in a collapsed 確認 cell"
    )
    for i, c in enumerate(main):
        if c.cell_type == "code" and _hidden(c):
            assert c.source.lstrip().startswith("# 確認"), (
                f"cell {i}: a collapsed cell is a 確認 cell ('# 確認 ...')"
            )
