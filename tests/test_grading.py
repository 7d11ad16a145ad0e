"""The whole nbgrader grading cycle, run in temporary course directories.

For every assignment: generate_assignment -> submissions (the reference answers, the untouched release
and the submissions of tests/fixtures/submissions.toml) -> autograde -> generate_feedback -> export.
The assignments are split over two course directories, each with its own sqlite gradebook (sqlite is
not safe for parallel autograde), graded at the same time. Every nbgrader step handles all submissions
of its directory in one run, since each nbgrader start costs seconds. nbgrader runs as the command
found on PATH, the way an instructor runs it: `make test` puts .venv/bin first on PATH, and nbgrader
shells out to `alembic` from there when it creates a gradebook.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

from course_lib.check import CELL_TIMEOUT, IGNORED_STDERR, execute_copy
from course_lib.release import fill_answers, find_assignments

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "submissions.toml"
DOCS = ROOT / "README.md"  # its instructor section, between the instructor markers
ASSIGNMENTS = find_assignments(ROOT)
COURSE_ID = "efficient-training"
REFERENCE, UNTOUCHED = "reference", "untouched"
# A bound on one nbgrader command, so that a hung autograde fails the suite instead of hanging CI.
COMMAND_LIMIT = 900


@dataclass
class Submission:
    """A submission built from the reference answers with a few patches (tests/fixtures/)."""

    student: str
    assignment: str
    description: str
    loses: list[str]
    patches: list[dict]
    warns_in: list[str] = field(default_factory=list)

    def build(self, reference: nbformat.NotebookNode) -> nbformat.NotebookNode:
        """The reference notebook with this submission's patches applied."""
        nb = nbformat.from_dict(reference)
        cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in nb.cells}
        for patch in self.patches:
            cell = cells.get(patch["cell"])
            assert cell is not None, (
                f"{FIXTURES.name}: {self.student}: no cell {patch['cell']!r} in {self.assignment}"
            )
            if "source" in patch:
                cell.source = patch["source"]
                continue
            count = cell.source.count(patch["old"])
            assert count == 1, (
                f"{FIXTURES.name}: {self.student}: the text {patch['old']!r} occurs {count} times in cell "
                f"{patch['cell']!r} of {self.assignment}: update the patch to the current solution"
            )
            cell.source = cell.source.replace(patch["old"], patch["new"])
        return nb


def load_submissions() -> list[Submission]:
    """The submissions described in tests/fixtures/submissions.toml."""
    with FIXTURES.open("rb") as f:
        entries = tomllib.load(f)["submission"]
    return [
        Submission(
            student=e["student"],
            assignment=e["assignment"],
            description=" ".join(e["description"].split()),
            loses=e["loses"],
            patches=e["patch"],
            warns_in=e.get("warns_in", []),
        )
        for e in entries
    ]


SUBMISSIONS = load_submissions()


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the `nbgrader` on PATH in ``course``; fail with its output if it fails."""
    exe = shutil.which("nbgrader")
    assert exe, "no `nbgrader` on PATH: run the tests with `make test` (it puts .venv/bin first on PATH)"
    done = subprocess.run([exe, *args], cwd=course, capture_output=True, text=True, timeout=COMMAND_LIMIT)
    assert done.returncode == 0, (
        f"nbgrader {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    )
    return done


def read_notebook(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def cells_by_id(nb: nbformat.NotebookNode) -> dict[str, nbformat.NotebookNode]:
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells if "nbgrader" in c.metadata}


@dataclass
class GradedCourse:
    """One assignment's results, graded in a temporary course directory."""

    course: Path
    assignment: str
    students: list[str]
    scores: dict[str, dict[str, tuple[float, float]]]  # student -> test grade_id -> (score, max)
    log: str

    def notebook(self, folder: str, student: str) -> Path:
        return self.course / folder / student / self.assignment / f"{self.assignment}.ipynb"


def read_scores(
    course: Path, assignment: str, students: list[str]
) -> dict[str, dict[str, tuple[float, float]]]:
    """Per-student, per-test-cell scores from the course's gradebook."""
    from nbgrader.api import Gradebook

    scores = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        for student in students:
            nb = gb.find_submission_notebook(assignment, assignment, student)
            scores[student] = {g.name: (float(g.score), float(g.max_score)) for g in nb.grades}
    return scores


def submit(course: Path, assignment: str) -> list[str]:
    """Place every submission of ``assignment`` in ``submitted/``; return the student ids."""
    name = f"{assignment}.ipynb"
    release = read_notebook(course / "exercises" / assignment / name)
    reference = fill_answers(release, read_notebook(course / "solutions" / assignment / name))
    notebooks = {REFERENCE: reference, UNTOUCHED: release}
    notebooks |= {s.student: s.build(reference) for s in SUBMISSIONS if s.assignment == assignment}
    for student, nb in notebooks.items():
        folder = course / "submitted" / student / assignment
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / name)
    return list(notebooks)


def grade_course(course: Path, assignments: list[str]) -> list[GradedCourse]:
    """The cycle for ``assignments`` in one course directory: generate, submit, autograde, feedback, export."""
    (course / "solutions").mkdir(parents=True)
    for assignment in assignments:
        shutil.copytree(ROOT / "solutions" / assignment, course / "solutions" / assignment)
    shutil.copy2(ROOT / "nbgrader_config.py", course)
    log = [nbgrader(course, "generate_assignment", "*").stderr]
    students = {assignment: submit(course, assignment) for assignment in assignments}
    for step in (["autograde", "*"], ["generate_feedback", "*"], ["export", "--to", "grades.csv"]):
        log.append(nbgrader(course, *step).stderr)
    return [
        GradedCourse(course, a, students[a], read_scores(course, a, students[a]), "\n".join(log))
        for a in assignments
    ]


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, GradedCourse]:
    """Every assignment graded: two course directories (one gradebook each) graded at the same time."""
    base = tmp_path_factory.mktemp("grading")
    groups = [
        ASSIGNMENTS[i::2] for i in range(2)
    ]  # one nbgrader run per group and step, two groups in parallel
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        futures = [pool.submit(grade_course, base / f"course{i}", group) for i, group in enumerate(groups)]
        return {run.assignment: run for future in futures for run in future.result()}


def test_four_assignments_named_like_the_lessons():
    assert ASSIGNMENTS == ["00_intro", "01_device_placement", "02_distributed_concepts", "03_mixed_precision"]


def test_nbgrader_and_alembic_come_from_this_environment():
    """nbgrader shells out to `alembic`: both must be this environment's, found on PATH as in CI."""
    here = Path(sys.executable).parent
    for tool in ("nbgrader", "alembic"):
        found = shutil.which(tool)
        assert found, (
            f"`{tool}` is not on PATH: run the tests with `make test`, which puts {here} first on PATH"
        )
        assert os.path.samefile(Path(found).parent, here), (
            f"`{tool}` on PATH is {found}, not this environment's ({here}): run the tests with `make test`"
        )


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_reference_solutions_earn_full_marks(graded, assignment):
    scores = graded[assignment].scores[REFERENCE]
    lost = {cell: s for cell, s in scores.items() if s[0] != s[1]}
    assert scores and not lost, (
        f"the reference answers lost points in {lost}\n{graded[assignment].log[-3000:]}"
    )
    assert sum(m for _, m in scores.values()) >= 8


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_untouched_release_earns_zero(graded, assignment):
    scores = graded[assignment].scores[UNTOUCHED]
    earned = {cell: s for cell, s in scores.items() if s[0] != 0}
    assert scores and not earned, f"the unanswered release earned points in {earned}"


@pytest.mark.parametrize("submission", SUBMISSIONS, ids=lambda s: f"{s.assignment}-{s.student}")
def test_submission_loses_exactly_the_points_of_its_failing_tests(graded, submission):
    scores = graded[submission.assignment].scores[submission.student]
    unknown = set(submission.loses) - set(scores)
    assert not unknown, f"{FIXTURES.name}: {submission.student}: no test cells {sorted(unknown)}"
    expected = {cell: (0.0 if cell in submission.loses else m, m) for cell, (_, m) in scores.items()}
    wrong = {
        cell: f"scored {scores[cell][0]:g}, expected {expected[cell][0]:g}"
        for cell in scores
        if scores[cell] != expected[cell]
    }
    assert not wrong, f"{submission.student} ({submission.description}): {wrong}"


def test_runaway_cell_is_interrupted_and_grading_goes_on(graded):
    run = graded["00_intro"]
    cells = cells_by_id(read_notebook(run.notebook("autograded", "runaway_and_edited_test")))
    errors = [o for o in cells["test_time_matmul"].outputs if o.output_type == "error"]
    assert errors, "the cell with the infinite loop should end in an error"
    assert {o.ename for o in errors} & {"CellTimeoutError", "KeyboardInterrupt"}, [o.ename for o in errors]
    assert f"Timeout waiting for execute reply ({CELL_TIMEOUT}s)" in run.log, (
        "the configured cell timeout was not used"
    )
    # The test cells after the runaway one ran and passed.
    later = [cells[name] for name in ("test_matmul_flops", "test_gflops")]
    assert all(any("OK" in o.get("text", "") for o in c.outputs) for c in later), (
        "grading stopped at the runaway cell"
    )


def test_edited_test_cell_is_graded_with_the_original(graded):
    run = graded["00_intro"]
    submitted = cells_by_id(read_notebook(run.notebook("submitted", "runaway_and_edited_test")))
    graded_cells = cells_by_id(read_notebook(run.notebook("autograded", "runaway_and_edited_test")))
    source = cells_by_id(read_notebook(ROOT / "solutions" / "00_intro" / "00_intro.ipynb"))
    assert "edited by the student" in submitted["test_pick_device"].source
    assert graded_cells["test_pick_device"].source == source["test_pick_device"].source
    assert "BEGIN HIDDEN TESTS" in graded_cells["test_pick_device"].source, "hidden tests should be restored"
    assert run.scores["runaway_and_edited_test"]["test_pick_device"][0] == 0


def test_hidden_tests_run_at_autograde_time(graded):
    for assignment, run in graded.items():
        source = cells_by_id(read_notebook(ROOT / "solutions" / assignment / f"{assignment}.ipynb"))
        autograded = cells_by_id(read_notebook(run.notebook("autograded", REFERENCE)))
        tests = [gid for gid, c in source.items() if c.metadata["nbgrader"].get("grade")]
        for gid in tests:
            assert autograded[gid].source == source[gid].source, (
                f"{assignment}: {gid} was not graded with its source"
            )
        assert any("BEGIN HIDDEN TESTS" in source[gid].source for gid in tests), (
            f"{assignment} has no hidden tests"
        )


def test_library_warnings_do_not_cost_points(graded):
    """A correct answer that makes torch warn inside a test cell keeps its points."""
    (submission,) = [s for s in SUBMISSIONS if s.student == "library_warnings"]
    run = graded[submission.assignment]
    scores = run.scores[submission.student]
    assert all(s == m for s, m in scores.values()), (
        f"a correct submission with warnings lost points: {scores}"
    )
    # The premise: run as submitted, those test cells really write a warning to stderr, which alone
    # would score 0 without the IgnorePattern set in nbgrader_config.py.
    from nbgrader.utils import determine_grade

    executed = cells_by_id(execute_copy(run.notebook("submitted", submission.student)))
    for gid in submission.warns_in:
        stderr = "".join(o.get("text", "") for o in executed[gid].outputs if o.get("name") == "stderr")
        assert "UserWarning" in stderr, f"{gid} printed no warning: the fixture no longer tests anything"
        assert re.search(IGNORED_STDERR, stderr)
        assert determine_grade(executed[gid])[0] == 0, (
            "nbgrader would keep the points even without IgnorePattern"
        )


def test_feedback_for_every_submission(graded):
    for assignment, run in graded.items():
        for student in run.students:
            html = run.course / "feedback" / student / assignment / f"{assignment}.html"
            assert html.is_file(), f"no feedback for {student} on {assignment}"
            score = sum(s for s, _ in run.scores[student].values())
            total = sum(m for _, m in run.scores[student].values())
            text = html.read_text(encoding="utf-8")
            assert re.search(rf"Score:\s*{score:g}(\.0)?\s*/\s*{total:g}(\.0)?", text), (
                f"the feedback of {student} on {assignment} does not show its score {score:g} / {total:g}"
            )


def test_grades_exported_to_csv(graded):
    for assignment, run in graded.items():
        with (run.course / "grades.csv").open(newline="") as f:
            rows = {r["student_id"]: r for r in csv.DictReader(f) if r["assignment"] == assignment}
        assert set(run.students) <= set(rows), "every submission has a row"
        for student in run.students:
            row = rows[student]
            assert float(row["score"]) == sum(s for s, _ in run.scores[student].values()), (student, row)
            assert float(row["max_score"]) == sum(m for _, m in run.scores[student].values()), (student, row)


def bash_blocks(markdown: str) -> list[str]:
    """The ```bash code blocks of a Markdown document, in order."""
    return re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M)


def instructor_section() -> str:
    """The README's instructor guide (between ``<!-- instructor:start -->`` and ``<!-- instructor:end -->``)."""
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index("<!-- instructor:start -->") : text.index("<!-- instructor:end -->")]


@pytest.fixture(scope="module")
def instructor_course(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the course where every command of the README's instructor section ran, in order."""
    base = tmp_path_factory.mktemp("instructor")
    course = base / "course"
    course.mkdir()
    for name in ("solutions", "exercises"):
        shutil.copytree(ROOT / name, course / name)
    shutil.copy2(ROOT / "nbgrader_config.py", course)
    (course / ".venv").symlink_to(ROOT / ".venv")
    script = "set -euo pipefail\n" + "\n".join(bash_blocks(instructor_section()))
    (base / "tmp").mkdir()
    env = {
        **os.environ,
        "EXCHANGE": str(base / "exchange"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "TMPDIR": str(base / "tmp"),  # the guide's `mktemp -d` student folder
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=course, env=env, capture_output=True, text=True, timeout=COMMAND_LIMIT
    )
    return course, done


def test_instructor_guide_commands_work_as_written(instructor_course):
    course, done = instructor_course
    assert len(bash_blocks(instructor_section())) >= 7
    assert done.returncode == 0, (
        f"a command of {DOCS.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    (student,) = [p.name for p in (course / "submitted").iterdir()]
    assert (course / "feedback" / student / "00_intro" / "00_intro.html").is_file()
    with (course / "grades.csv").open(newline="") as f:
        (row,) = [r for r in csv.DictReader(f) if r["assignment"] == "00_intro"]
    assert row["student_id"] == student and float(row["score"]) == float(row["max_score"]) > 0, row
    assert "formgrader" in done.stdout


def test_formgrader_serves_the_graded_course(instructor_course):
    """JupyterLab started in the course folder serves the formgrader with the autograded submission."""
    import json
    import socket
    import time
    import urllib.request

    course, done = instructor_course
    assert done.returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "course-test"
    cmd = [shutil.which("jupyter"), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}"]
    cmd.append(f"--IdentityProvider.token={token}")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(course.parent / "runtime")}
    server = subprocess.Popen(
        cmd, cwd=course, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}/formgrader/api/submissions/00_intro?token={token}"
        deadline, submissions = time.monotonic() + 180, None
        while submissions is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    submissions = json.load(response)
            except OSError:
                time.sleep(0.5)
        assert submissions is not None, (
            f"the formgrader did not answer:\n{server.stderr.read() if server.poll() is not None else ''}"
        )
        (submission,) = submissions
        assert submission["score"] == submission["max_score"] > 0, submission
    finally:
        server.terminate()
        server.wait(timeout=30)
