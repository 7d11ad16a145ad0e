"""The student release exercises/ is generated from solutions/ and checked for drift (`make release`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_tools.release import (
    check_release,
    fill_answers,
    find_assignments,
    main,
    strip_solution_markers,
)

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = find_assignments(ROOT)


def release(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_tools.release", "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def course(tmp_path) -> Path:
    """A copy of the course sources and the committed release."""
    for name in ("solutions", "exercises"):
        shutil.copytree(ROOT / name, tmp_path / name)
    shutil.copy2(ROOT / "nbgrader_config.py", tmp_path)
    return tmp_path


def test_committed_release_is_up_to_date():
    done = release("--check")
    assert done.returncode == 0, f"exercises/ is stale: run `make release`.\n{done.stdout}{done.stderr}"


def test_every_assignment_is_released():
    assert ASSIGNMENTS
    for name in ASSIGNMENTS:
        assert (ROOT / "exercises" / name / f"{name}.ipynb").is_file()
    assert sorted(p.name for p in (ROOT / "exercises").iterdir() if p.is_dir()) == ASSIGNMENTS


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_release_holds_no_solution_and_no_hidden_test(name):
    text = (ROOT / "exercises" / name / f"{name}.ipynb").read_text(encoding="utf-8")
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text, f"exercises/{name} leaks {marker!r}"
    nb = nbformat.read(ROOT / "exercises" / name / f"{name}.ipynb", as_version=4)
    answers = [c for c in nb.cells if c.metadata["nbgrader"].get("solution")]
    assert answers and all("raise NotImplementedError()" in c.source for c in answers)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "the release has outputs"


def lesson_headings(name: str) -> list[str]:
    """The Markdown headings of lesson ``notebooks/<name>.ipynb``, without '#', numbers and spaces."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    lines = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()]
    return [re.sub(r"^#+\s*[\d.]*\s*", "", line).replace(" ", "") for line in lines if line.startswith("#")]


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_every_task_names_an_existing_section_of_its_lesson(name):
    nb = nbformat.read(ROOT / "solutions" / name / f"{name}.ipynb", as_version=4)
    tasks = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    graded = [c for c in nb.cells if c.metadata["nbgrader"].get("grade")]
    assert tasks and graded and all(c.metadata["nbgrader"]["points"] > 0 for c in graded)
    headings = lesson_headings(name)
    for task in tasks:
        if "採点されません" in task:  # the ungraded "try it" section
            continue
        (line,) = [x for x in task.splitlines() if x.startswith("練習するレッスンの節:")]
        assert f"`notebooks/{name}.ipynb` の「" in line, (
            f"{name}: {task.splitlines()[0]} does not name its lesson"
        )
        for title in re.findall(r"「(.+?)」", line):
            assert any(title.replace(" ", "") in h for h in headings), (
                f"{name}: {task.splitlines()[0]} names the section 「{title}」, which notebooks/{name}.ipynb lacks"
            )


# A task's text states what to do in about 600 characters; the details go into the tests' feedback (issue 47).
TASK_TEXT_LIMIT = 650


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_every_task_text_is_short_and_the_first_cell_gives_the_minutes(name):
    nb = nbformat.read(ROOT / "solutions" / name / f"{name}.ipynb", as_version=4)
    long = {
        c.source.splitlines()[0]: len(c.source)
        for c in nb.cells
        if c.cell_type == "markdown" and c.source.startswith("## ") and len(c.source) > TASK_TEXT_LIMIT
    }
    assert not long, f"{name}: task texts over {TASK_TEXT_LIMIT} characters: {long}"
    assert re.search(r"所要時間の目安: \d+ 分", nb.cells[0].source), (
        f"{name}: the first cell should give the minutes the exercise takes (所要時間の目安: N 分)"
    )


def test_check_finds_an_edited_solution_and_release_fixes_it(course):
    path = course / "solutions" / "02_distributed_concepts" / "02_distributed_concepts.ipynb"
    nb = nbformat.read(path, as_version=4)
    test_cell = next(c for c in nb.cells if c.metadata["nbgrader"].get("grade"))
    test_cell.source += "\nassert True"
    nbformat.write(nb, path)

    stale = release("--check", "02_distributed_concepts", root=course)
    assert stale.returncode == 1
    gid = test_cell.metadata["nbgrader"]["grade_id"]
    assert f"({gid}): source differs" in stale.stdout, stale.stdout
    assert "make release" in stale.stdout

    assert release("02_distributed_concepts", root=course).returncode == 0
    assert check_release(course, ["02_distributed_concepts"]) == []


def test_check_compares_cells_not_bytes(course):
    path = course / "exercises" / "00_intro" / "00_intro.ipynb"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(
        json.dumps(data, indent=4, ensure_ascii=True), encoding="utf-8"
    )  # other bytes, same cells
    assert check_release(course, ["00_intro"]) == []
    data["cells"][1]["metadata"]["nbgrader"]["points"] = 99
    path.write_text(json.dumps(data), encoding="utf-8")
    (problem,) = check_release(course, ["00_intro"])
    assert problem.endswith("cell 1 (setup): nbgrader metadata differs"), problem


def test_check_finds_missing_and_leftover_exercises(course):
    for name in ASSIGNMENTS[1:]:  # keep the test quick: generate one assignment
        shutil.rmtree(course / "solutions" / name)
        shutil.rmtree(course / "exercises" / name)
    (course / "exercises" / "00_intro" / "00_intro.ipynb").unlink()
    (course / "exercises" / "99_old").mkdir()
    problems = check_release(course)
    assert len(problems) == 2 and problems[0].endswith("00_intro.ipynb: missing"), problems
    assert problems[1].endswith("99_old: no source in solutions/ (stale)"), problems


def test_bad_input_gets_an_error_that_says_what_to_do(tmp_path, course, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--check", "--root", str(empty)]) == 2
    assert "is not the course root" in capsys.readouterr().err
    assert main(["--check", "04_nope", "--root", str(course)]) == 2
    assert "choose from 00_intro" in capsys.readouterr().err
    assert main(["--answers", "00_intro", "--out", str(empty), "--root", str(empty)]) == 2
    assert "is not the course root" in capsys.readouterr().err


def test_answers_fill_every_answer_cell_with_the_reference(tmp_path):
    done = release("--answers", "00_intro", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    filled = nbformat.read(tmp_path / "00_intro.ipynb", as_version=4)
    source = nbformat.read(ROOT / "solutions" / "00_intro" / "00_intro.ipynb", as_version=4)
    release_nb = nbformat.read(ROOT / "exercises" / "00_intro" / "00_intro.ipynb", as_version=4)
    assert len(filled.cells) == len(source.cells) == len(release_nb.cells)
    for mine, ref, rel in zip(filled.cells, source.cells, release_nb.cells):
        if mine.metadata["nbgrader"].get("solution"):
            assert mine.source == strip_solution_markers(ref.source)
            assert "NotImplementedError" not in mine.source and "BEGIN SOLUTION" not in mine.source
        else:
            assert mine.source == rel.source and mine.metadata == rel.metadata


def test_fill_answers_rejects_a_foreign_notebook():
    release_nb = nbformat.read(ROOT / "exercises" / "00_intro" / "00_intro.ipynb", as_version=4)
    other = nbformat.read(
        ROOT / "solutions" / "01_device_placement" / "01_device_placement.ipynb", as_version=4
    )
    with pytest.raises(KeyError, match="no counterpart"):
        fill_answers(release_nb, other)


def test_make_release_runs_this_module():
    done = subprocess.run(["make", "-n", "release"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "python -m course_tools.release" in done.stdout, done.stdout + done.stderr
