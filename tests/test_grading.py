"""Grading: the whole nbgrader cycle, and the fixture matrix that tests the tests.

1. The nbgrader cycle, run in temporary course directories, for every assignment: generate_assignment ->
   submissions (the reference answers, the untouched release and the submissions of
   tests/fixtures/submissions.toml marked `graded_by = "nbgrader"`: an edited test cell, deleted test
   cells, a runaway cell, library warnings, a 5 MB line of output) -> autograde -> generate_feedback ->
   export. The assignments are split over two course directories, each with its own sqlite gradebook
   (sqlite is not safe for parallel autograde), graded at the same time. Every nbgrader step handles all
   submissions of its directory in one run, since each nbgrader start costs seconds. nbgrader runs as the
   command found on PATH, the way an instructor runs it: `make test` puts .venv/bin first on PATH, and
   nbgrader shells out to `alembic` from there when it creates a gradebook.
2. The fixture matrix: every other wrong submission (submissions.toml) and every alternative correct
   answer (tests/fixtures/alternatives.toml), run with the course's own check runner (course_lib.cli.check:
   the autograder's scoring) on the notebook autograde runs, hidden tests included, each in a kernel
   process of its own forked from one that has imported torch already (tests/preloaded_kernels.py:
   the matrix's set-up took 326 s on 2 cores with fresh kernels, 219 s with these).
   Alternatives ride along in a wrong submission's notebook wherever they cannot mask or be masked by its
   mistakes, so each assignment runs a few notebooks, not one per fixture; they run alongside the cycle
   (one module fixture, `grading_runs`, does both). The coverage test then checks,
   from the measured scores, that every test cell is failed by a wrong answer and passed by every other
   fixture, and that every answer cell has an alternative correct answer that earns full marks.
3. The instructors' guide (docs/instructors.md), every command as written, and the formgrader serving its result.

One thread pool (`GradingJobs`, MATRIX_WORKERS jobs at a time) runs all of it: the two course
directories, the instructor guide and the matrix notebooks share the two cores from the start, so no
single-threaded step runs alone after the others. Each notebook runs once: the tests read the module
fixtures' results.
"""

from __future__ import annotations

import ast
import csv
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from preloaded_kernels import PreloadServer

from course_lib.cli.check import CELL_TIMEOUT, IGNORED_STDERR, cell_seconds, check_notebook, execute_copy
from course_tools.grading import NOTE, OUTPUT_CHAR_LIMIT, LimitOutputSize, released_source
from course_tools.release import fill_answers, find_assignments, strip_solution_markers

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "submissions.toml"
ALTERNATIVES = ROOT / "tests" / "fixtures" / "alternatives.toml"
DOCS = ROOT / "docs" / "instructors.md"  # the instructors' guide, between the instructor markers
ALL_ASSIGNMENTS = find_assignments(ROOT)
COURSE_ID = "efficient-training"
REFERENCE, UNTOUCHED = "reference", "untouched"
# A bound on one nbgrader command, so that a hung autograde fails the suite instead of hanging CI.
COMMAND_LIMIT = 900
# Notebooks run three at a time on 2 cores: one OpenMP thread each, or torch's threads thrash
# (CONTRIBUTING, "Threads and load").
KERNEL_ENV = {"OMP_NUM_THREADS": "1"}
# Jobs of the grading pool at once (GradingJobs): while the two gradebooks grade, the third worker runs
# the instructor guide, then matrix notebooks; all three take matrix notebooks once the courses are done.
MATRIX_WORKERS = 3
# While developing one assignment: COURSE_GRADING_ONLY=04_accumulation_checkpointing pytest tests/test_grading.py
# grades only the named assignments (comma-separated). `make test` grades every one.
ONLY = {a for a in os.environ.get("COURSE_GRADING_ONLY", "").split(",") if a}


def apply_patches(nb: nbformat.NotebookNode, patches: list[dict], owner: str) -> nbformat.NotebookNode:
    """A copy of ``nb`` with ``patches`` (tests/fixtures/ format) applied to the cells they name."""
    nb = nbformat.from_dict(nb)
    for patch in patches:
        cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in nb.cells}
        cell = cells.get(patch["cell"])
        assert cell is not None, f"{owner}: no cell {patch['cell']!r}"
        if patch.get("delete"):
            nb.cells.remove(cell)
        elif "source" in patch:
            cell.source = patch["source"]
        else:
            count = cell.source.count(patch["old"])
            assert count == 1, (
                f"{owner}: the text {patch['old']!r} occurs {count} times in cell {patch['cell']!r}: "
                "update the patch to the current solution"
            )
            cell.source = cell.source.replace(patch["old"], patch["new"])
    return nb


@dataclass
class Submission:
    """A submission built from the reference answers with a few patches (tests/fixtures/submissions.toml)."""

    student: str
    assignment: str
    description: str
    loses: list[str]
    patches: list[dict]
    warns_in: list[str] = field(default_factory=list)
    graded_by: str = "check"  # "check": in the fixture matrix; "nbgrader": in the nbgrader cycle
    huge_output_in: list[str] = field(default_factory=list)

    @property
    def cells(self) -> set[str]:
        return {p["cell"] for p in self.patches}

    def build(self, reference: nbformat.NotebookNode) -> nbformat.NotebookNode:
        """The reference notebook with this submission's patches applied."""
        return apply_patches(reference, self.patches, f"{FIXTURES.name}: {self.student} ({self.assignment})")


@dataclass
class Alternative:
    """An alternative correct answer (tests/fixtures/alternatives.toml): it must earn full marks."""

    name: str
    assignment: str
    description: str
    patches: list[dict]

    @property
    def cells(self) -> set[str]:
        return {p["cell"] for p in self.patches}

    def build(self, reference: nbformat.NotebookNode) -> nbformat.NotebookNode:
        return apply_patches(reference, self.patches, f"{ALTERNATIVES.name}: {self.name} ({self.assignment})")


def load_submissions() -> list[Submission]:
    """The submissions described in tests/fixtures/submissions.toml."""
    with FIXTURES.open("rb") as f:
        entries = tomllib.load(f)["submission"]
    submissions = [
        Submission(
            student=e["student"],
            assignment=e["assignment"],
            description=" ".join(e["description"].split()),
            loses=e["loses"],
            patches=e["patch"],
            warns_in=e.get("warns_in", []),
            graded_by=e.get("graded_by", "check"),
            huge_output_in=e.get("huge_output_in", []),
        )
        for e in entries
    ]
    assert all(s.graded_by in ("check", "nbgrader") for s in submissions), "graded_by: 'check' or 'nbgrader'"
    return submissions


def load_alternatives() -> list[Alternative]:
    """The alternative correct answers described in tests/fixtures/alternatives.toml."""
    with ALTERNATIVES.open("rb") as f:
        entries = tomllib.load(f)["alternative"]
    return [
        Alternative(
            name=e["name"],
            assignment=e["assignment"],
            description=" ".join(e["description"].split()),
            patches=e["patch"],
        )
        for e in entries
    ]


ASSIGNMENTS = [a for a in ALL_ASSIGNMENTS if not ONLY or a in ONLY]
SUBMISSIONS = [s for s in load_submissions() if s.assignment in ASSIGNMENTS]
ALTERNATIVE_ANSWERS = [a for a in load_alternatives() if a.assignment in ASSIGNMENTS]


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the `nbgrader` on PATH in ``course``; fail with its output if it fails."""
    exe = shutil.which("nbgrader")
    assert exe, "no `nbgrader` on PATH: run the tests with `make test` (it puts .venv/bin first on PATH)"
    env = {**os.environ, **KERNEL_ENV}  # the kernels it starts inherit this
    done = subprocess.run(
        [exe, *args], cwd=course, env=env, capture_output=True, text=True, timeout=COMMAND_LIMIT
    )
    # The first traceback says why; the end of the log says which step gave up.
    first = done.stderr.find("Traceback")
    cause = done.stderr[first : first + 4000] + "\n...\n" if first >= 0 else ""
    assert done.returncode == 0, (
        f"nbgrader {' '.join(args)} failed ({done.returncode}):\n{cause}{done.stderr[-3000:]}"
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
    manual: dict[str, set[str]] = field(default_factory=dict)  # student -> cells flagged for manual grading

    def notebook(self, folder: str, student: str) -> Path:
        return self.course / folder / student / self.assignment / f"{self.assignment}.ipynb"


def read_grades(
    course: Path, assignment: str, students: list[str]
) -> dict[str, dict[str, tuple[float, float, bool]]]:
    """Per-student, per-test-cell (score, max score, needs manual grading) from the course's gradebook."""
    from nbgrader.api import Gradebook

    grades = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        for student in students:
            nb = gb.find_submission_notebook(assignment, assignment, student)
            grades[student] = {
                g.name: (float(g.score), float(g.max_score), bool(g.needs_manual_grade)) for g in nb.grades
            }
    return grades


def submitted_reference(course: Path, assignment: str) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    """(the release of ``assignment`` in ``course``, the release with the reference answers filled in)."""
    name = f"{assignment}.ipynb"
    release = read_notebook(course / "exercises" / assignment / name)
    return release, fill_answers(release, read_notebook(course / "solutions" / assignment / name))


def submit(course: Path, assignment: str) -> list[str]:
    """Place every submission of ``assignment`` in ``submitted/``; return the student ids."""
    name = f"{assignment}.ipynb"
    release, reference = submitted_reference(course, assignment)
    notebooks = {REFERENCE: reference, UNTOUCHED: release}
    notebooks |= {
        s.student: s.build(reference)
        for s in SUBMISSIONS
        if s.assignment == assignment and s.graded_by == "nbgrader"
    }
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
    runs = []
    for a in assignments:
        grades = read_grades(course, a, students[a])
        scores = {student: {g: (s, m) for g, (s, m, _) in cells.items()} for student, cells in grades.items()}
        manual = {
            student: {g for g, (_, _, flag) in cells.items() if flag} for student, cells in grades.items()
        }
        runs.append(GradedCourse(course, a, students[a], scores, "\n".join(log), manual))
    return runs


class GradingJobs:
    """The module's one thread pool, and the jobs submitted to it by name, each at most once.

    Every notebook run and nbgrader command of this file goes through it, so that the whole tier keeps
    MATRIX_WORKERS jobs going on the two cores instead of running its single-threaded steps (the
    instructor guide's commands, the formgrader start, the warnings premise) one after the other once
    the pool is done.
    """

    def __init__(self, base: Path):
        self.base = base
        self.pool = ThreadPoolExecutor(max_workers=MATRIX_WORKERS)
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()
        self._kernels: PreloadServer | None = None

    def kernels(self) -> PreloadServer:
        """The matrix's kernel server (tests/preloaded_kernels.py), started on first use."""
        with self.lock:
            if self._kernels is None:
                self._kernels = PreloadServer(self.base / "preload", env=KERNEL_ENV)
            return self._kernels

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._kernels is not None:
            self._kernels.close()

    def submit(self, name: str, fn, *args) -> Future:
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(fn, *args)
            return self.futures[name]

    def as_submitted(self, submission: Submission) -> Future:
        """``submission`` executed as submitted, without the autograder (see ``execute_as_submitted``)."""
        folder = self.base / f"as_submitted_{submission.student}"
        return self.submit(f"as submitted: {submission.student}", execute_as_submitted, folder, submission)

    def instructor(self) -> Future:
        """The instructor guide's commands, then the formgrader (see ``run_instructor_guide``)."""
        return self.submit("instructor", run_instructor_guide, self.base / "instructor")


@pytest.fixture(scope="module")
def grading_jobs(tmp_path_factory):
    jobs = GradingJobs(tmp_path_factory.mktemp("grading"))
    yield jobs
    jobs.close()


@pytest.fixture(scope="module")
def grading_runs(grading_jobs, request) -> tuple[dict[str, GradedCourse], dict[str, MatrixResult]]:
    """The nbgrader cycle and the fixture matrix, run side by side.

    The cycle grades the assignments in two course directories (one gradebook each) at the same time;
    the instructor guide's flow and the warnings premise start next, on the third worker, and the matrix
    notebooks follow, slow assignments first, on whichever worker is free. Three workers on two cores
    fill the time the cycle waits (nbgrader starting, the runaway cell idling to the time limit); every
    kernel uses one OpenMP thread. The instructor guide runs when a selected test needs it; that test
    finds it done.
    """
    base = grading_jobs.base
    groups = [g for g in (ASSIGNMENTS[i::2] for i in range(2)) if g]  # one nbgrader run per group and step
    courses = [
        grading_jobs.submit(f"course{i}", grade_course, base / f"course{i}", group)
        for i, group in enumerate(groups)
    ]
    if any("instructor_course" in item.fixturenames for item in request.session.items):
        grading_jobs.instructor()  # only when a selected test needs it
    for submission in (s for s in SUBMISSIONS if s.warns_in):
        grading_jobs.as_submitted(submission)
    order = sorted(MATRIX, key=lambda r: -ASSIGNMENTS.index(r.assignment))
    kernels = grading_jobs.kernels()  # imports torch & co. once, while the courses start
    runs = [
        grading_jobs.submit(f"matrix:{run.name}", run_matrix_notebook, base / f"matrix{i}", run, kernels)
        for i, run in enumerate(order)
    ]
    graded = {course.assignment: course for future in courses for course in future.result()}
    matrix = {result.run.name: result for result in (future.result() for future in runs)}
    return graded, matrix


@pytest.fixture(scope="module")
def graded(grading_runs) -> dict[str, GradedCourse]:
    """Every assignment through the nbgrader cycle, by assignment."""
    return grading_runs[0]


@pytest.fixture(scope="module")
def matrix(grading_runs) -> dict[str, MatrixResult]:
    """Every notebook of the fixture matrix, by run name."""
    return grading_runs[1]


# ---------------------------------------------------------------- the fixture matrix


def graded_reference(assignment: str) -> nbformat.NotebookNode:
    """The notebook autograde runs for the reference answers: the source, hidden tests included."""
    nb = read_notebook(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = strip_solution_markers(cell.source)
    return nb


def cells_of(assignment: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """(answer cell -> the test cells that follow it, test cell -> points) of ``assignment``."""
    nb = read_notebook(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    answers, points, current = {}, {}, None
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            current = meta["grade_id"]
            answers[current] = []
        elif meta.get("grade") and meta.get("points"):
            points[meta["grade_id"]] = float(meta["points"])
            if current is not None:
                answers[current].append(meta["grade_id"])
    return answers, points


@dataclass
class MatrixRun:
    """One notebook of the fixture matrix: a wrong submission (or none) and the alternatives riding along."""

    assignment: str
    submission: Submission | None
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def name(self) -> str:
        names = [self.submission.student] if self.submission else []
        return "+".join(names + [a.name for a in self.alternatives])

    @property
    def loses(self) -> set[str]:
        return set(self.submission.loses) if self.submission else set()

    @property
    def cells(self) -> set[str]:
        cells = set(self.submission.cells) if self.submission else set()
        return cells.union(*(a.cells for a in self.alternatives))

    def build(self) -> nbformat.NotebookNode:
        nb = graded_reference(self.assignment)
        for part in [self.submission, *self.alternatives]:
            if part is not None:
                nb = part.build(nb)
        return nb


def plan_matrix() -> list[MatrixRun]:
    """The notebooks of the matrix: each wrong submission, with alternatives packed in where they are safe.

    An alternative joins a notebook that patches none of its cells and whose expected losses include
    none of its cells' tests (so a mistake cannot hide a failing alternative, nor an alternative a
    mistake); the others share notebooks of alternatives only.
    """
    runs = []
    for assignment in ASSIGNMENTS:
        answers, _ = cells_of(assignment)
        mine = [MatrixRun(assignment, s) for s in SUBMISSIONS if s.assignment == assignment]
        mine = [r for r in mine if r.submission.graded_by == "check"]
        for alternative in (a for a in ALTERNATIVE_ANSWERS if a.assignment == assignment):
            tests = {t for cell in alternative.cells for t in answers.get(cell, [])}
            host = next(
                (r for r in mine if not r.cells & alternative.cells and not r.loses & tests),
                None,
            )
            if host is None:
                host = MatrixRun(assignment, None)
                mine.append(host)
            host.alternatives.append(alternative)
        runs += mine
    return runs


MATRIX = plan_matrix()


def fewest_matrix_notebooks() -> int:
    """The fewest notebooks any plan needs: a notebook holds one version of each answer cell, so an
    assignment needs as many as the fixtures (matrix submissions and alternatives) of its busiest cell."""
    fewest = 0
    for assignment in ASSIGNMENTS:
        parts = [s for s in SUBMISSIONS if s.assignment == assignment and s.graded_by == "check"]
        parts += [a for a in ALTERNATIVE_ANSWERS if a.assignment == assignment]
        answers, _ = cells_of(assignment)
        fewest += max((sum(cell in p.cells for p in parts) for cell in answers), default=0)
    return fewest


@dataclass
class MatrixResult:
    run: MatrixRun
    scores: dict[str, tuple[float, float]]  # test grade_id -> (score, max)
    errors: dict[str, str]  # test grade_id -> the error of a failed test
    seconds: float
    cell_seconds: dict[str, float] = field(default_factory=dict)  # grade_id -> seconds, every cell that ran


def run_matrix_notebook(folder: Path, run: MatrixRun, kernels: PreloadServer) -> MatrixResult:
    """``run`` through the course's check runner, in a kernel forked from ``kernels`` (a process of its
    own, with torch and transformers already imported: tests/preloaded_kernels.py)."""
    folder.mkdir(parents=True)
    path = folder / f"{run.assignment}.ipynb"
    nbformat.write(run.build(), path)
    report = check_notebook(path, env={**KERNEL_ENV, **kernels.kernel_env}, km=kernels.kernel_manager())
    scores = {t.grade_id: (t.points, t.max_points) for t in report.tests}
    errors = {t.grade_id: t.error or "" for t in report.tests if not t.passed}
    return MatrixResult(run, scores, errors, report.seconds, report.cell_seconds)


def measured_scores(graded, matrix, assignment: str, owner: Submission | Alternative) -> dict:
    """The per-test scores of the notebook that holds ``owner`` (nbgrader cycle or matrix)."""
    if isinstance(owner, Submission) and owner.graded_by == "nbgrader":
        return graded[assignment].scores[owner.student]
    (run,) = [r for r in MATRIX if owner is r.submission or owner in r.alternatives]
    return matrix[run.name].scores


@pytest.mark.slow
def test_matrix_notebooks_score_exactly_as_expected(matrix):
    """Every matrix notebook loses exactly the points of its wrong answers; the alternatives lose none."""
    problems = []
    for result in matrix.values():
        run = result.run
        expected = {cell: (0.0 if cell in run.loses else m, m) for cell, (_, m) in result.scores.items()}
        wrong = {
            cell: f"scored {result.scores[cell][0]:g}, expected {expected[cell][0]:g}"
            + (f" ({result.errors[cell]})" if cell in result.errors else "")
            for cell in result.scores
            if result.scores[cell] != expected[cell]
        }
        if wrong:
            parts = [f"{run.submission.student}: {run.submission.description}"] if run.submission else []
            parts += [f"{a.name} (alternative): {a.description}" for a in run.alternatives]
            problems.append(f"{run.assignment} [{run.name}]: {wrong}\n    " + "\n    ".join(parts))
    assert not problems, "\n".join(problems)


# The three classes of wrong answers that earned full marks (issue 47), as tests/fixtures/ tag them at the start
# of a fixture's description: [class 1] right only on the grader's machine (judged on the CPU alone),
# [class 2] behaviour the task text names that no test exercised (an edge input, stale gradients, several
# parameter groups), [class 3] an instruction about *how* that no test observed (on the fly, synchronising,
# an integer result); [alternative API] marks a correct answer through another public API.
FIXTURE_CLASSES = ("class 1", "class 2", "class 3")
FIXTURE_TAGS = (*FIXTURE_CLASSES, "alternative API")
# Assignments in which no task's right answer depends on the machine: no class-1 fixture applies.
MACHINE_INDEPENDENT = {
    "01b_images_audio": "images and clips are prepared on the CPU, whatever the machine",
    "02_distributed_concepts": "ranks simulated in one process, on the CPU",
    "06_efficient_optimizers": "optimizer state and Trainer's optim= names are the same on every device",
    "06b_memory_and_sharding": "byte counts from the architecture, autocast on the CPU",
}


def fixture_tags(description: str) -> set[str]:
    """The tags at the start of a fixture's description: "[class 1] [alternative API] ..." -> {...}."""
    tags = set()
    for tag in re.match(r"^((?:\[[^\]]+\]\s*)*)", description)[1].split("]"):
        tag = tag.strip(" [")
        if tag:
            assert tag in FIXTURE_TAGS, (
                f"unknown fixture tag [{tag}] in {description[:80]!r}: use {FIXTURE_TAGS}"
            )
            tags.add(tag)
    return tags


def test_fixture_tags_are_read_from_the_start_of_a_description():
    assert fixture_tags("[class 1] [alternative API] pick_device asks [class 2]") == {
        "class 1",
        "alternative API",
    }
    assert fixture_tags("right for the shown case only (class 1, ...)") == set()
    with pytest.raises(AssertionError, match="unknown fixture tag"):
        fixture_tags("[class 4] a fourth class")


def test_every_assignment_has_a_wrong_answer_and_an_alternative_of_each_class():
    """For each class of issue 47, each assignment whose fixtures are tagged has a wrong answer of that class
    (which must lose points) and an alternative of it (which must keep them); the grading tier checks both.
    Assignments without any tagged fixture (exercise 07, added beside this change) are not held to it yet."""
    submissions, alternatives = load_submissions(), load_alternatives()
    missing = []
    for assignment in ALL_ASSIGNMENTS:
        subs = [fixture_tags(s.description) for s in submissions if s.assignment == assignment]
        alts = [fixture_tags(a.description) for a in alternatives if a.assignment == assignment]
        if not any(subs + alts):
            continue
        for tag in FIXTURE_CLASSES:
            if tag == "class 1" and assignment in MACHINE_INDEPENDENT:
                assert not any(tag in t for t in subs + alts), (
                    f"{assignment} has a [class 1] fixture: remove it from MACHINE_INDEPENDENT"
                )
                continue
            missing += [f"{assignment}: no wrong answer tagged [{tag}]"] * (not any(tag in t for t in subs))
            missing += [f"{assignment}: no alternative tagged [{tag}]"] * (not any(tag in t for t in alts))
    assert not missing, "\n".join(missing)


def test_alternatives_are_written_differently():
    """An alternative's cells differ from the reference's in their syntax tree, not just in comments."""
    for alternative in ALTERNATIVE_ANSWERS:
        reference = cells_by_id(graded_reference(alternative.assignment))
        mine = cells_by_id(alternative.build(graded_reference(alternative.assignment)))
        answers, _ = cells_of(alternative.assignment)
        for cell in alternative.cells:
            assert cell in answers, (
                f"{ALTERNATIVES.name}: {alternative.name} patches {cell!r}, not an answer cell"
            )
            assert ast.dump(ast.parse(mine[cell].source)) != ast.dump(ast.parse(reference[cell].source)), (
                f"{ALTERNATIVES.name}: {alternative.name}: cell {cell!r} is the reference answer re-spaced"
            )


def coverage_table(graded, matrix) -> tuple[list[str], list[str]]:
    """The coverage of the tests by the fixtures, measured: (table lines, problems)."""
    lines, problems = [], []
    for assignment in ASSIGNMENTS:
        answers, points = cells_of(assignment)
        submissions = [s for s in SUBMISSIONS if s.assignment == assignment]
        alternatives = [a for a in ALTERNATIVE_ANSWERS if a.assignment == assignment]
        measured = {s.student: measured_scores(graded, matrix, assignment, s) for s in submissions}
        measured |= {a.name: measured_scores(graded, matrix, assignment, a) for a in alternatives}
        # Every graded notebook with the tests it may fail: the reference, the nbgrader submissions and
        # the matrix notebooks (a wrong submission with the alternatives riding along, or alternatives).
        notebooks = [(REFERENCE, graded[assignment].scores[REFERENCE], set())]
        notebooks += [
            (s.student, measured[s.student], set(s.loses)) for s in submissions if s.graded_by == "nbgrader"
        ]
        notebooks += [
            (name, result.scores, result.run.loses)
            for name, result in matrix.items()
            if result.run.assignment == assignment
        ]
        lines.append(f"{assignment} ({sum(points.values()):g} points)")
        for answer, tests in answers.items():
            good = [
                a.name
                for a in alternatives
                if answer in a.cells and all(measured[a.name][t][0] == points[t] for t in tests)
            ]
            lines.append(f"  answer {answer:<28} alternatives: {', '.join(good) or '-- NONE --'}")
            if not good:
                problems.append(
                    f"{assignment}: answer cell {answer!r} has no alternative that earns full marks"
                )
            for test in tests:
                failed_by = [
                    s.student for s in submissions if test in s.loses and measured[s.student][test][0] == 0
                ]
                unexpected = [
                    name
                    for name, scores, loses in notebooks
                    if test not in loses and scores[test][0] != points[test]
                ]
                lines.append(
                    f"    test {test:<36} {points[test]:>2g} pt  failed by: {', '.join(failed_by) or '-- NONE --'}"
                    + (f"  (also by {', '.join(unexpected)}: NOT EXPECTED)" if unexpected else "")
                )
                if not failed_by:
                    problems.append(f"{assignment}: test cell {test!r} is failed by no wrong answer")
                if unexpected:
                    problems.append(
                        f"{assignment}: test cell {test!r} lost points it should not in {unexpected}"
                    )
    return lines, problems


@pytest.mark.slow
def test_every_test_fails_a_wrong_answer_and_every_answer_has_an_alternative(graded, matrix, capsys):
    """Coverage of the tests, measured: every test cell is failed by at least one wrong answer and passed
    by every other fixture; every answer cell has an alternative correct answer earning full marks."""
    lines, problems = coverage_table(graded, matrix)
    with capsys.disabled():
        print("\n\nCoverage of the tests by tests/fixtures/ (measured):\n" + "\n".join(lines))
        seconds = sum(r.seconds for r in matrix.values())
        print(
            f"fixture matrix: {len(matrix)} notebooks (at least {fewest_matrix_notebooks()}: one version of "
            f"each answer cell per notebook), {seconds:.0f} s of notebook time\n"
        )
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the nbgrader cycle


def test_every_assignment_is_named_like_its_lesson():
    assert ONLY <= set(ALL_ASSIGNMENTS), (
        f"COURSE_GRADING_ONLY names no assignment: {ONLY - set(ALL_ASSIGNMENTS)}"
    )
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))  # 01_, 01b_
    orphans = [a for a in ALL_ASSIGNMENTS if a not in lessons]
    assert ALL_ASSIGNMENTS and not orphans, f"assignments without a lesson of the same name: {orphans}"


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


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_reference_solutions_earn_full_marks(graded, assignment):
    scores = graded[assignment].scores[REFERENCE]
    lost = {cell: s for cell, s in scores.items() if s[0] != s[1]}
    assert scores and not lost, (
        f"the reference answers lost points in {lost}\n{graded[assignment].log[-3000:]}"
    )
    assert sum(m for _, m in scores.values()) >= 8
    # No cell of the reference raised, graded or not (setup and answer cells too): the check nbval ran
    # on solutions/ before this autograde became the one run of the solutions (issue #22).
    autograded = read_notebook(graded[assignment].notebook("autograded", REFERENCE))
    raised = [
        i
        for i, c in enumerate(autograded.cells)
        if any(o.output_type == "error" for o in c.get("outputs", []))
    ]
    assert not raised, f"cells {raised} of the autograded reference of {assignment} raised an error"


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_untouched_release_earns_zero(graded, assignment):
    scores = graded[assignment].scores[UNTOUCHED]
    earned = {cell: s for cell, s in scores.items() if s[0] != 0}
    assert scores and not earned, f"the unanswered release earned points in {earned}"


@pytest.mark.slow
@pytest.mark.parametrize("submission", SUBMISSIONS, ids=lambda s: f"{s.assignment}-{s.student}")
def test_submission_loses_exactly_the_points_of_its_failing_tests(request, submission):
    """Graded by nbgrader or in the fixture matrix, a submission loses exactly its failing tests' points."""
    graded = request.getfixturevalue("graded")
    matrix = request.getfixturevalue("matrix") if submission.graded_by == "check" else None
    scores = measured_scores(graded, matrix, submission.assignment, submission)
    unknown = set(submission.loses) - set(scores)
    assert not unknown, f"{FIXTURES.name}: {submission.student}: no test cells {sorted(unknown)}"
    expected = {cell: (0.0 if cell in submission.loses else m, m) for cell, (_, m) in scores.items()}
    wrong = {
        cell: f"scored {scores[cell][0]:g}, expected {expected[cell][0]:g}"
        for cell in scores
        if scores[cell] != expected[cell]
    }
    assert not wrong, f"{submission.student} ({submission.description}): {wrong}"


@pytest.mark.slow
@pytest.mark.parametrize("alternative", ALTERNATIVE_ANSWERS, ids=lambda a: f"{a.assignment}-{a.name}")
def test_alternative_answer_earns_full_marks(graded, matrix, alternative):
    scores = measured_scores(graded, matrix, alternative.assignment, alternative)
    answers, _ = cells_of(alternative.assignment)
    (run,) = [r for r in MATRIX if alternative in r.alternatives]
    lost = {
        t: matrix[run.name].errors.get(t, "")
        for cell in alternative.cells
        for t in answers[cell]
        if scores[t][0] != scores[t][1]
    }
    assert not lost, (
        f"{alternative.name} ({alternative.description}) lost points in {lost} (notebook {run.name})"
    )


def test_point_totals_are_the_ones_the_instructor_guide_states():
    section = instructor_section()
    stated = {
        m[1]: (int(m[2]), int(m[3]))
        for m in re.finditer(r"\|\s*`(\w+)`\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", section)
    }
    for assignment in ALL_ASSIGNMENTS:
        _, points = cells_of(assignment)
        measured = (round(sum(points.values())), len(points))
        assert stated.get(assignment) == measured, (
            f"docs/instructors.md should state {measured[0]} points in {measured[1]} test cells "
            f"for {assignment} (the table row: | `{assignment}` | points | test cells |), not {stated.get(assignment)}"
        )


def graded_run(graded, assignment: str) -> GradedCourse:
    """``graded[assignment]``; the test is skipped when COURSE_GRADING_ONLY leaves the assignment out."""
    if assignment not in graded and ONLY:
        pytest.skip(f"COURSE_GRADING_ONLY leaves {assignment} out")
    return graded[assignment]


def the_submission(condition) -> Submission:
    """The one submission that meets ``condition`` (skipped when COURSE_GRADING_ONLY leaves it out)."""
    found = [s for s in SUBMISSIONS if condition(s)]
    if not found and ONLY:
        pytest.skip("COURSE_GRADING_ONLY leaves this fixture's assignment out")
    (submission,) = found
    return submission


@pytest.mark.slow
def test_runaway_cell_is_interrupted_and_grading_goes_on(graded):
    run = graded_run(graded, "00_intro")
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


@pytest.mark.slow
def test_edited_test_cell_is_graded_with_the_original(graded):
    run = graded_run(graded, "00_intro")
    submitted = cells_by_id(read_notebook(run.notebook("submitted", "runaway_and_edited_test")))
    graded_cells = cells_by_id(read_notebook(run.notebook("autograded", "runaway_and_edited_test")))
    source = cells_by_id(read_notebook(ROOT / "solutions" / "00_intro" / "00_intro.ipynb"))
    assert "edited by the student" in submitted["test_pick_device"].source
    assert graded_cells["test_pick_device"].source == source["test_pick_device"].source
    assert "BEGIN HIDDEN TESTS" in graded_cells["test_pick_device"].source, "hidden tests should be restored"
    assert run.scores["runaway_and_edited_test"]["test_pick_device"][0] == 0


@pytest.mark.slow
def test_deleted_test_cells_are_restored_and_graded(graded):
    """With OverwriteCells.add_missing_cells, deleted test cells come back, hidden tests included, and
    are graded like the others: no zero for a right answer, no manual grading."""
    submission = the_submission(lambda s: any(p.get("delete") for p in s.patches))
    run = graded[submission.assignment]
    deleted = [p["cell"] for p in submission.patches if p.get("delete")]
    submitted = cells_by_id(read_notebook(run.notebook("submitted", submission.student)))
    autograded = cells_by_id(read_notebook(run.notebook("autograded", submission.student)))
    source = cells_by_id(graded_reference(submission.assignment))
    scores = run.scores[submission.student]
    for gid in deleted:
        assert gid not in submitted, "the submission should lack the deleted cell"
        assert gid in autograded, f"the deleted test cell {gid} was not restored"
        assert autograded[gid].source.endswith(source[gid].source), f"{gid} was not restored as it was"
        assert "BEGIN HIDDEN TESTS" in autograded[gid].source, f"{gid}: hidden tests should be restored"
        assert "missing from the submission" in autograded[gid].source, "the restored cell should say so"
        expected = 0.0 if gid in submission.loses else scores[gid][1]
        assert scores[gid][0] == expected, f"{gid} scored {scores[gid][0]:g}, expected {expected:g}"
    assert not run.manual[submission.student], (
        f"cells flagged for manual grading: {run.manual[submission.student]}"
    )


@pytest.mark.slow
def test_long_output_lines_are_cut_in_the_autograded_notebook_and_the_feedback(graded):
    """LimitOutputSize (course_tools.grading) bounds a cell's output: a 5 MB line does not reach the graded
    notebook or the feedback whole, and the cell keeps its grade."""
    submission = the_submission(lambda s: s.huge_output_in)
    run = graded[submission.assignment]
    path = run.notebook("autograded", submission.student)
    cells = cells_by_id(read_notebook(path))
    for gid in submission.huge_output_in:
        text = "".join(o.get("text", "") for o in cells[gid].outputs)
        assert "output truncated by the autograder" in text, f"{gid}: no truncation note in {text[:200]!r}"
        size = sum(len(str(o)) for o in cells[gid].outputs)
        assert size < OUTPUT_CHAR_LIMIT + 1000, f"{gid} kept {size:,} characters of output"
    reference = run.notebook("autograded", REFERENCE)
    assert path.stat().st_size < reference.stat().st_size + 5 * OUTPUT_CHAR_LIMIT, (
        f"the autograded notebook is {path.stat().st_size:,} bytes"
    )
    feedback = run.course / "feedback" / submission.student / run.assignment / f"{run.assignment}.html"
    reference_feedback = run.course / "feedback" / REFERENCE / run.assignment / f"{run.assignment}.html"
    assert feedback.stat().st_size < reference_feedback.stat().st_size + 5 * OUTPUT_CHAR_LIMIT, (
        f"the feedback page is {feedback.stat().st_size:,} bytes"
    )
    assert "output truncated by the autograder" in feedback.read_text(encoding="utf-8")


def test_output_size_limit_keeps_the_grade_and_says_what_it_cut():
    """LimitOutputSize alone: cuts every kind of output to the budget, never drops one, marks each cut."""
    from nbgrader.utils import determine_grade

    big = "z" * 50_000
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "grade_id": "t", "points": 1}
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"text/html": big, "text/plain": "a table"}),
        nbformat.v4.new_output("stream", name="stdout", text=big),
        nbformat.v4.new_output("stream", name="stderr", text=big),
        nbformat.v4.new_output("error", ename="AssertionError", evalue=big, traceback=[big, big]),
    ]
    nb = nbformat.v4.new_notebook(cells=[cell])
    limiter = LimitOutputSize(max_chars=1000)
    cut, _ = limiter.preprocess(nb, {})
    outputs = cut.cells[0].outputs
    assert [o.output_type for o in outputs] == ["display_data", "stream", "stream", "error"]
    assert outputs[0].data == {"text/plain": "a table"}, "an HTML page cut in half would break the feedback"
    assert outputs[1].text.startswith("z" * 993) and "50,000 characters, the first 993" in outputs[1].text
    assert outputs[2].name == "stderr" and "truncated" in outputs[2].text, "a write to stderr stays one"
    assert len(str(outputs)) < 1000 + 6 * len(NOTE) + 600
    assert determine_grade(cut.cells[0])[0] == 0, "an error still scores zero"
    small = nbformat.v4.new_code_cell("1")
    small.outputs = [nbformat.v4.new_output("stream", name="stdout", text="fine\n")]
    kept, _ = LimitOutputSize(max_chars=1000).preprocess(nbformat.v4.new_notebook(cells=[small]), {})
    assert kept.cells[0].outputs[0].text == "fine\n"


@pytest.mark.slow
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


def test_released_test_cells_are_their_source_without_the_hidden_tests():
    """The premise of QuietOverwriteCells: every locked cell of the release is its source cell with the
    hidden-test region removed (released_source), so a cell equal to that was not edited."""
    for assignment in ALL_ASSIGNMENTS:
        source = cells_by_id(read_notebook(ROOT / "solutions" / assignment / f"{assignment}.ipynb"))
        release = cells_by_id(read_notebook(ROOT / "exercises" / assignment / f"{assignment}.ipynb"))
        for gid, cell in source.items():
            if cell.metadata["nbgrader"].get("locked") and cell.cell_type == "code":
                assert release[gid].source == released_source(cell.source), (
                    f"{assignment}: the released {gid} is not its source without the hidden tests: "
                    "run python -m course_tools.release"
                )


@pytest.mark.slow
def test_autograde_reports_only_cells_a_student_edited(graded):
    """nbgrader's "Attribute 'checksum' for cell ... has changed!" names only test cells a submission edited,
    not every cell whose hidden tests the release stripped (course_tools.grading.QuietOverwriteCells)."""
    for assignment, run in graded.items():
        locked = {
            gid
            for gid, cell in cells_by_id(graded_reference(assignment)).items()
            if cell.metadata["nbgrader"].get("locked")
        }
        edited = {
            p["cell"]
            for s in SUBMISSIONS
            if s.assignment == assignment and s.graded_by == "nbgrader"
            for p in s.patches
            if p["cell"] in locked and not p.get("delete")
        }
        cells = set(cells_by_id(graded_reference(assignment)))
        reported = set(re.findall(r"Attribute 'checksum' for cell (\S+) has changed", run.log)) & cells
        assert reported == edited, (
            f"{assignment}: autograde reported {sorted(reported)} as changed; the submissions edited {sorted(edited)}"
        )


# The grading cell limit needs headroom: a reference cell may take at most a third of it under the
# grading pool's own parallel load (several notebooks on two cores), so that a slower grader's
# machine does not cut off correct answers.
HEADROOM = 3


def slowest_reference_cells(graded, matrix) -> dict[str, tuple[float, str, str]]:
    """Per assignment: (seconds, cell, notebook) of the slowest cell that held the reference's code.

    Every cell of the reference's autograded notebook counts: nbgrader ran it in a fresh kernel, so its
    set-up cells include the imports a grader's kernel pays for. In the matrix notebooks (preloaded
    kernels: the imports are done) the cells of the course and the test cells of reference answers count
    too; the cells a fixture patched, and the tests of answers it patched, do not.
    """
    slowest: dict[str, tuple[float, str, str]] = {}

    def note(assignment: str, cell: str, seconds: float, where: str) -> None:
        if seconds > slowest.get(assignment, (0.0,))[0]:
            slowest[assignment] = (seconds, cell, where)

    for assignment, run in graded.items():
        for c in read_notebook(run.notebook("autograded", REFERENCE)).cells:
            grade_id = c.metadata.get("nbgrader", {}).get("grade_id")
            if c.cell_type == "code" and grade_id and (seconds := cell_seconds(c)) is not None:
                note(assignment, grade_id, seconds, "nbgrader's reference")
    for name, result in matrix.items():
        answers, _ = cells_of(result.run.assignment)
        patched = result.run.cells | {t for cell in result.run.cells for t in answers.get(cell, [])}
        for cell, seconds in result.cell_seconds.items():
            if cell not in patched:
                note(result.run.assignment, cell, seconds, name)
    return slowest


@pytest.mark.slow
def test_reference_cells_leave_the_cell_limit_headroom(graded, matrix, capsys):
    """The slowest reference cell of each assignment, measured in the grading pool (the nbgrader cycle's
    reference and the fixture matrix), takes at most a third of the autograder's per-cell limit
    (CELL_TIMEOUT, nbgrader_config.py)."""
    slowest = slowest_reference_cells(graded, matrix)
    assert set(slowest) == set(graded), "every assignment's reference has timed cells"
    load = os.getloadavg()[0]
    with capsys.disabled():
        print(f"\n\nSlowest reference cell per assignment (grading pool, load average {load:.1f}):")
        for assignment, (seconds, cell, name) in sorted(slowest.items()):
            print(f"  {assignment:<32} {seconds:5.1f} s  {cell} (in {name})")
    too_slow = {a: v for a, v in slowest.items() if v[0] > CELL_TIMEOUT / HEADROOM}
    if too_slow and load > 2 * MATRIX_WORKERS:
        pytest.skip(
            f"the machine was busy beyond the pool's own {MATRIX_WORKERS} notebooks (load average {load:.1f}): "
            f"{too_slow} is not a measurement of the grader's headroom; rerun on a quiet machine"
        )
    assert not too_slow, (
        f"reference cells over a third of the {CELL_TIMEOUT} s cell limit: {too_slow}; split the cell or make "
        "it cheaper (a grader's slower machine would cut off correct answers)"
    )


def execute_as_submitted(folder: Path, submission: Submission) -> nbformat.NotebookNode:
    """``submission`` built from the committed release and solutions, run in a fresh kernel as submitted
    (no IgnorePattern, no hidden tests): the outputs the autograder's IgnorePattern then filters."""
    folder.mkdir(parents=True)
    _, reference = submitted_reference(ROOT, submission.assignment)
    path = folder / f"{submission.assignment}.ipynb"
    nbformat.write(submission.build(reference), path)
    return execute_copy(path, env=KERNEL_ENV)


@pytest.mark.slow
def test_library_warnings_do_not_cost_points(graded, grading_jobs):
    """A correct answer that makes torch warn inside a test cell keeps its points."""
    submission = the_submission(lambda s: s.student == "library_warnings")
    run = graded[submission.assignment]
    scores = run.scores[submission.student]
    assert all(s == m for s, m in scores.values()), (
        f"a correct submission with warnings lost points: {scores}"
    )
    # The premise: run as submitted, those test cells really write a warning to stderr, which alone
    # would score 0 without the IgnorePattern set in nbgrader_config.py.
    from nbgrader.utils import determine_grade

    executed = grading_jobs.as_submitted(submission).result()  # run in the pool, beside the cycle
    submitted = read_notebook(run.notebook("submitted", submission.student))
    assert [c.source for c in executed.cells] == [c.source for c in submitted.cells], (
        "the premise ran another notebook than the one submitted"
    )
    executed = cells_by_id(executed)
    for gid in submission.warns_in:
        stderr = "".join(o.get("text", "") for o in executed[gid].outputs if o.get("name") == "stderr")
        assert "UserWarning" in stderr, f"{gid} printed no warning: the fixture no longer tests anything"
        assert re.search(IGNORED_STDERR, stderr)
        assert determine_grade(executed[gid])[0] == 0, (
            "nbgrader would keep the points even without IgnorePattern"
        )


@pytest.mark.slow
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


@pytest.mark.slow
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
    """The instructors' guide, docs/instructors.md (between ``<!-- instructor:start -->`` and ``<!-- instructor:end -->``)."""
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index("<!-- instructor:start -->") : text.index("<!-- instructor:end -->")]


@dataclass
class InstructorRun:
    """The instructors' guide (docs/instructors.md), run as written in a copy of the course, and the formgrader after it."""

    course: Path
    done: subprocess.CompletedProcess
    formgrader: Formgrader | None  # None when a command of the guide failed


@dataclass
class Formgrader:
    """What JupyterLab, started in the graded course, answered on the formgrader's API."""

    submissions: list | None  # the API's JSON for 00_intro; None if it never answered
    port: int | None
    server: str  # "running" or "exited N" when the asking stopped
    log: str


def run_instructor_guide(base: Path) -> InstructorRun:
    """Every command of the instructors' guide, in order, in a copy of the course; then the
    formgrader of the graded course (``ask_formgrader``). A job of the grading pool."""
    course = base / "course"
    course.mkdir(parents=True)
    for name in ("solutions", "exercises"):
        shutil.copytree(ROOT / name, course / name)
    shutil.copy2(ROOT / "nbgrader_config.py", course)
    (course / ".venv").symlink_to(ROOT / ".venv")
    script = "set -euo pipefail\n" + "\n".join(bash_blocks(instructor_section()))
    (base / "tmp").mkdir()
    env = {
        **os.environ,
        **KERNEL_ENV,  # it runs beside two other jobs of the pool
        "EXCHANGE": str(base / "exchange"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "TMPDIR": str(base / "tmp"),  # the guide's `mktemp -d` student folder
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=course, env=env, capture_output=True, text=True, timeout=COMMAND_LIMIT
    )
    formgrader = ask_formgrader(course, base / "formgrader") if done.returncode == 0 else None
    return InstructorRun(course, done, formgrader)


def ask_formgrader(course: Path, folder: Path) -> Formgrader:
    """Start JupyterLab in ``course`` and ask the formgrader's API for the submissions of 00_intro.

    The server picks its own free port (``--port=0``); its port is read from the server's runtime file
    (``jpserver-<pid>.json``) and the API asked on 127.0.0.1. The server's log goes to a file, so that a
    full pipe cannot block it.
    """
    import json
    import time
    import urllib.request

    folder.mkdir(parents=True)
    runtime, token = folder / "runtime", "course-test"
    cmd = [shutil.which("jupyter"), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", "--port=0"]
    cmd.append(f"--IdentityProvider.token={token}")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
    log_path = folder / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, cwd=course, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, port, submissions = time.monotonic() + 180, None, None
        while submissions is None and time.monotonic() < deadline and server.poll() is None:
            if port is None:
                infos = [json.loads(p.read_text()) for p in runtime.glob("jpserver-*.json")]
                port = next((i["port"] for i in infos if i.get("pid") == server.pid), None)
            if port is not None:
                url = f"http://127.0.0.1:{port}/formgrader/api/submissions/00_intro?token={token}"
                try:
                    with urllib.request.urlopen(url, timeout=10) as response:
                        submissions = json.load(response)
                    break
                except OSError:
                    pass
            time.sleep(0.5)
        state = "running" if server.poll() is None else f"exited {server.returncode}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    return Formgrader(submissions, port, state, log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def instructor_course(grading_jobs) -> InstructorRun:
    """The instructor guide's run: started by ``grading_runs`` when the grading tier runs (so it shares
    the pool), or here when only the instructor tests were asked for."""
    return grading_jobs.instructor().result()


@pytest.mark.slow
def test_instructor_guide_commands_work_as_written(instructor_course):
    course, done = instructor_course.course, instructor_course.done
    assert len(bash_blocks(instructor_section())) >= 7
    assert done.returncode == 0, (
        f"a command of {DOCS.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    (student,) = [p.name for p in (course / "submitted").iterdir()]
    assert (course / "feedback" / student / "00_intro" / "00_intro.html").is_file()
    with (course / "grades.csv").open(newline="") as f:
        (row,) = [r for r in csv.DictReader(f) if r["assignment"] == "00_intro"]
    assert row["student_id"] == student and float(row["score"]) == float(row["max_score"]) > 0, row
    # `jupyter server extension list` colours its status: "enabled" must follow the extension's name
    # ("formgrader disabled" also names it). That it serves pages is the next test's business.
    listed = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)
    assert re.search(r"nbgrader\.server_extensions\.formgrader\s+enabled\b", listed), (
        f"the guide's extension check does not list the formgrader as enabled:\n{listed[-2000:]}"
    )


@pytest.mark.slow
def test_formgrader_serves_the_graded_course(instructor_course):
    """JupyterLab started in the course folder serves the formgrader with the autograded submission
    (asked in the grading pool right after the guide's commands: ``ask_formgrader``)."""
    assert instructor_course.done.returncode == 0
    answer = instructor_course.formgrader
    assert answer.submissions is not None, (
        f"the formgrader did not answer (port {answer.port}, server {answer.server}):\n{answer.log[-3000:]}"
    )
    (submission,) = answer.submissions
    assert submission["score"] == submission["max_score"] > 0, submission
