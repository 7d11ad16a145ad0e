"""The student release exercises/ is generated from solutions/ and checked for drift (`make release`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.release import fill_answers, find_assignments, strip_solution_markers

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = find_assignments(ROOT)


def release(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_lib.release", "--root", str(root), *args],
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


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_exercises_name_their_lesson_section_in_japanese(name):
    nb = nbformat.read(ROOT / "solutions" / name / f"{name}.ipynb", as_version=4)
    tasks = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    graded = [c for c in nb.cells if c.metadata["nbgrader"].get("grade")]
    assert tasks and graded and all(c.metadata["nbgrader"]["points"] > 0 for c in graded)
    for task in tasks:
        if "採点されません" in task:
            continue
        assert f"`notebooks/{name}.ipynb` の「" in task, f"{name}: a task does not say which lesson section it practises"


def test_check_finds_an_edited_solution_and_release_fixes_it(course):
    path = course / "solutions" / "02_distributed_concepts" / "02_distributed_concepts.ipynb"
    nb = nbformat.read(path, as_version=4)
    test_cell = next(c for c in nb.cells if c.metadata["nbgrader"].get("grade"))
    test_cell.source += "\nassert True"
    nbformat.write(nb, path)

    stale = release("--check", root=course)
    assert stale.returncode == 1
    gid = test_cell.metadata["nbgrader"]["grade_id"]
    assert f"({gid}): source differs" in stale.stdout, stale.stdout
    assert "make release" in stale.stdout

    assert release(root=course).returncode == 0
    assert release("--check", root=course).returncode == 0


def test_check_compares_cells_not_bytes(course):
    path = course / "exercises" / "00_intro" / "00_intro.ipynb"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, indent=4, ensure_ascii=True), encoding="utf-8")  # other bytes, same cells
    assert release("--check", "00_intro", root=course).returncode == 0
    data["cells"][1]["metadata"]["nbgrader"]["points"] = 99
    path.write_text(json.dumps(data), encoding="utf-8")
    done = release("--check", "00_intro", root=course)
    assert done.returncode == 1 and "nbgrader metadata differs" in done.stdout, done.stdout


def test_check_finds_missing_and_leftover_exercises(course):
    shutil.rmtree(course / "exercises" / "03_mixed_precision")
    (course / "exercises" / "99_old").mkdir()
    (course / "exercises" / "99_old" / "99_old.ipynb").write_text("{}")
    done = release("--check", root=course)
    assert done.returncode == 1
    assert "03_mixed_precision.ipynb: missing" in done.stdout and "99_old: no source" in done.stdout, done.stdout


def test_bad_input_gets_an_error_that_says_what_to_do(tmp_path, course):
    elsewhere = release("--check", root=tmp_path)
    assert elsewhere.returncode == 2 and "is not the course root" in elsewhere.stderr
    unknown = release("--check", "04_nope", root=course)
    assert unknown.returncode == 2 and "choose from 00_intro" in unknown.stderr


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
    other = nbformat.read(ROOT / "solutions" / "01_device_placement" / "01_device_placement.ipynb", as_version=4)
    with pytest.raises(KeyError, match="no counterpart"):
        fill_answers(release_nb, other)
