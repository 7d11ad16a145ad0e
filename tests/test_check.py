"""The learner's self-check, `python -m course_lib.cli.check NOTEBOOK` (`make check NB=...`).

It runs a temporary copy, scores the visible tests as the autograder does, and never modifies the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.cli.check import (
    CellScore,
    CheckReport,
    _error_line,
    execute_copy,
    format_report,
    main,
    modified_locked_cells,
    tell_apart,
)
from course_tools.release import write_answers

ROOT = Path(__file__).resolve().parents[1]
# The quickest exercise: the runner is the same for all (tests/test_grading.py runs every assignment with it).
EXERCISE = ROOT / "exercises" / "00_intro" / "00_intro.ipynb"


def run_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_lib.cli.check", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_untouched_release_fails_every_test_without_being_modified():
    before, stamp = EXERCISE.read_bytes(), EXERCISE.stat().st_mtime_ns
    neighbours = sorted(EXERCISE.parent.iterdir())
    done = run_check(EXERCISE)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Score (点数): 0 / 8 points" in done.stdout, done.stdout
    results = [
        line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith("  PASS") or line.startswith("  FAIL")
    ]
    assert results == ["FAIL"] * 4, done.stdout
    assert "not solved yet" in done.stdout  # the unanswered cells are pointed out
    assert EXERCISE.read_bytes() == before and EXERCISE.stat().st_mtime_ns == stamp, (
        "the learner's file changed"
    )
    assert sorted(EXERCISE.parent.iterdir()) == neighbours, "the check left files beside the notebook"


@pytest.mark.slow
def test_correct_answers_get_full_marks(tmp_path):
    answered = write_answers(ROOT, "00_intro", tmp_path)
    before = answered.read_bytes()
    done = run_check(answered)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Score (点数): 8 / 8 points" in done.stdout, done.stdout
    assert "FAIL" not in done.stdout
    assert answered.read_bytes() == before


@pytest.mark.slow
def test_edited_read_only_cells_are_reported():
    nb = nbformat.read(EXERCISE, as_version=4)
    assert modified_locked_cells(nb) == []
    test_cell = next(c for c in nb.cells if c.metadata["nbgrader"].get("grade"))
    test_cell.source = "print('all good')"
    assert modified_locked_cells(nb) == [test_cell.metadata["nbgrader"]["grade_id"]]


def test_bad_input_gets_an_error_that_says_what_to_do(tmp_path, capsys):
    assert main([str(tmp_path / "nope.ipynb")]) == 2
    assert "Give the path of an exercise" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main([str(text)]) == 2
    assert "is not a notebook" in capsys.readouterr().err
    plain = tmp_path / "plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), plain)
    assert main([str(plain)]) == 2
    assert "not an exercise notebook" in capsys.readouterr().err


def test_make_check_runs_this_module():
    done = subprocess.run(
        ["make", "-n", "check", f"NB={EXERCISE}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and f'python -m course_lib.cli.check "{EXERCISE}"' in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_missing_kernel_gets_an_error_that_says_what_to_do(tmp_path, capsys):
    nb = nbformat.read(EXERCISE, as_version=4)
    nb.metadata["kernelspec"]["name"] = "no-such-kernel"
    path = tmp_path / EXERCISE.name
    nbformat.write(nb, path)
    assert main([str(path)]) == 2
    assert "No Jupyter kernel named 'no-such-kernel'" in capsys.readouterr().err


def test_the_kernel_gets_nbgrader_execution_and_extra_env_and_this_process_keeps_its_own(tmp_path):
    """As nbgrader does, the kernel sees NBGRADER_EXECUTION; ``env`` adds to it (e.g. one OpenMP thread when
    notebooks run side by side); this process's environment is not changed, so threads may share it."""
    probe = "import os\nprint(os.environ.get('NBGRADER_EXECUTION'), os.environ.get('COURSE_CHECK_PROBE'))"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(probe)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    before = dict(os.environ)
    executed = execute_copy(path, env={"COURSE_CHECK_PROBE": "yes"})
    assert executed.cells[0].outputs[0]["text"] == "validate yes\n"
    assert dict(os.environ) == before


def test_a_failing_tests_whole_message_is_shown():
    """The learner sees every character of a test's message, every line of it: the end of a long
    message is where it says by how much the answer is off (it was cut at 160 characters)."""
    message = (
        "time_to_target(3200, 200.0, compile_s=30.0): the time to target is examples / examples per "
        "second + compile seconds, 3200 / 200.0 + 30.0 = 46 s, but the answer was 640030 s; "
        "ending here: expected 46, got 640030\nsecond line: the inputs were (3200, 200.0, 30.0)"
    )
    cell = nbformat.v4.new_code_cell(
        "raise AssertionError(...)",
        outputs=[nbformat.v4.new_output("error", ename="AssertionError", evalue=message, traceback=[])],
    )
    error = _error_line(cell)
    assert error == f"AssertionError: {message}"
    report = CheckReport(
        notebook=Path("exercise.ipynb"),
        tests=[CellScore("test_time_to_target", 0.0, 2.0, error)],
        answer_errors={"time_to_target": f"ValueError: {message}"},
    )
    shown = format_report(report)
    first, second = message.splitlines()
    assert f"FAIL  test_time_to_target  0 / 2   AssertionError: {first}" in shown, shown
    assert f"  time_to_target: ValueError: {first}" in shown, shown
    assert shown.count(f"\n        {second}\n") == 2, shown  # the further line, indented, for both


def test_tell_apart_shows_unequal_numbers_unequal():
    assert tell_apart(16.0, 46.0) == ["16", "46"]
    assert tell_apart(0.1, 0.1000001) == ["0.1", "0.1000001"]
    assert tell_apart(1 / 1.05, 0.9523809523809524) == ["0.9523809523809523", "0.9523809523809524"]
    assert tell_apart(0.25, 0.25) == ["0.25", "0.25"]  # equal numbers read alike
    assert tell_apart(3, 3.0) == ["3", "3"]
    assert tell_apart(2, 2.5, digits=1) == ["2", "2.5"]  # one more digit where one is not enough
    assert tell_apart(None, 0.5) == ["None", "0.5"]
    assert tell_apart(0.123456, 0.123457, 7) == ["0.123456", "0.123457", "7"]
