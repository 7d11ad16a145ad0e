"""The learner's self-check: run an exercise notebook in a temporary copy and show its test results.

    python -m course_lib.cli.check exercises/01_device_placement/01_device_placement.ipynb
    make check NB=exercises/01_device_placement/01_device_placement.ipynb
    course-check exercises/01_device_placement/01_device_placement.ipynb

The notebook is copied to a temporary folder and run there top to bottom in a fresh kernel, with the
autograder's per-cell time limit; your file is never modified. Each test cell is scored as nbgrader
scores it: full points unless it raises an error. Hidden tests run only when the instructor grades, so
full marks here are necessary, not sufficient. Exit status: 0 full marks, 1 points missing, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Shared with nbgrader_config.py, so that the self-check and the autograder agree.
CELL_TIMEOUT = 30  # seconds per cell: every reference cell needs a few seconds on 2 CPU cores
# stderr that is not a failure: Python warnings ("file.py:12: UserWarning: ...") and tqdm progress bars.
IGNORED_STDERR = r"(?m)^\S.*:\d+: \w*Warning: |\d+%\|"
TIMEOUT_ERROR = {
    "ename": "CellTimeoutError",
    "evalue": "the cell was still running after the time limit and was interrupted (an infinite loop?)",
    "traceback": ["CellTimeoutError: the cell was interrupted at the time limit"],
}


@dataclass
class CellScore:
    """Score of one test cell."""

    grade_id: str
    points: float
    max_points: float
    error: str | None = None  # "AssertionError: ..." when the test failed

    @property
    def passed(self) -> bool:
        return self.points == self.max_points


@dataclass
class CheckReport:
    """What a self-check found: per-test scores, answer cells that raised, edited test cells."""

    notebook: Path
    tests: list[CellScore] = field(default_factory=list)
    answer_errors: dict[str, str] = field(default_factory=dict)  # grade_id -> "NameError: ..."
    modified_cells: list[str] = field(default_factory=list)  # locked cells edited by the learner
    seconds: float = 0.0
    cell_seconds: dict[str, float] = field(default_factory=dict)  # grade_id -> seconds the kernel spent on it

    @property
    def score(self) -> float:
        return sum(t.points for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_points for t in self.tests)

    @property
    def full_marks(self) -> bool:
        return self.score == self.max_score


def _nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def load_exercise(path: str | Path):
    """Read an exercise notebook; raise a clear error if it is not an nbgrader exercise."""
    import nbformat

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No notebook at {path}. Give the path of an exercise, e.g. "
            "exercises/01_device_placement/01_device_placement.ipynb"
        )
    if path.suffix != ".ipynb":
        raise ValueError(f"{path} is not a notebook (.ipynb): give the exercise notebook itself.")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # JSON or schema errors
        raise ValueError(f"{path} is not a readable notebook ({err}).") from err
    if not any(_nbgrader_meta(c).get("grade") for c in nb.cells):
        raise ValueError(
            f"{path} has no autograded test cells: it is not an exercise notebook. "
            "Exercises live in exercises/<assignment>/<assignment>.ipynb."
        )
    return nb


def modified_locked_cells(nb) -> list[str]:
    """grade_ids of read-only cells (tests, set-up, instructions) whose content was edited."""
    from nbgrader.utils import compute_checksum, is_locked

    edited = []
    for cell in nb.cells:
        meta = _nbgrader_meta(cell)
        if is_locked(cell) and "checksum" in meta and compute_checksum(cell) != meta["checksum"]:
            edited.append(meta.get("grade_id", "?"))
    return edited


def _error_line(cell) -> str | None:
    """The cell's error as ``"AssertionError: <the whole message>"`` (every line of it), or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            value = str(out.get("evalue", "")).strip()
            # rstrip: an error without a message reads "KeyboardInterrupt", not "KeyboardInterrupt: "
            return f"{out.get('ename', 'Error')}: {value}".rstrip(": ")
    return None


def tell_apart(*values, digits: int = 4) -> list[str]:
    """``values`` as text with the fewest significant digits (``digits`` or more) that show unequal
    numbers unequal, for a test's message: ``want, got = tell_apart(0.1, 0.1000001)`` gives
    ``"0.1"`` and ``"0.1000001"``, never two numbers that read the same. Equal numbers read alike,
    integers stay whole, and anything that is not a real number (None, a tensor, a string) is its repr.
    """
    import numbers

    def real(v) -> float | None:
        return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None

    def text(v, width: int) -> str:
        if real(v) is None:
            return repr(v)
        return str(int(v)) if isinstance(v, numbers.Integral) else f"{real(v):.{width}g}"

    numbers_shown = {real(v) for v in values if real(v) is not None}
    for width in range(digits, 18):  # 17 significant digits write every float64 exactly
        shown = [text(v, width) for v in values]
        if len({t for t, v in zip(shown, values) if real(v) is not None}) == len(numbers_shown):
            return shown
    return shown


def _parse_time(stamp: str) -> float:
    """Seconds since the epoch of one of nbclient's ISO 8601 timestamps (``2026-12-01T09:30:00.123456Z``)."""
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def cell_seconds(cell) -> float | None:
    """Seconds the kernel spent on ``cell``, from nbclient's timing metadata; None if it did not run."""
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    return _parse_time(end) - _parse_time(start)


def _drop_ignored_stderr(cell) -> None:
    """Remove stderr outputs that are warnings or progress bars (as nbgrader's IgnorePattern does)."""
    cell.outputs = [
        out
        for out in cell.get("outputs", [])
        if not (
            out.get("output_type") == "stream"
            and out.get("name") == "stderr"
            and re.search(IGNORED_STDERR, out.get("text", ""))
        )
    ]


def execute_copy(path: Path, timeout: int = CELL_TIMEOUT, env: dict[str, str] | None = None, km=None):
    """Run a copy of ``path`` in a temporary folder (a fresh kernel); return the executed notebook.

    The kernel gets this process's environment with ``NBGRADER_EXECUTION`` set, as nbgrader does, and
    ``env`` on top (e.g. ``{"OMP_NUM_THREADS": "1"}`` when several notebooks run at once). This
    process's own environment is left alone, so several copies may run at once from threads. ``km``: a
    jupyter_client KernelManager to start the kernel with (default: the notebook's kernelspec).
    """
    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient import NotebookClient

    def record_timeout(cell, cell_index, execute_reply):  # nbclient reports a timeout only here
        if execute_reply["content"].get("status") == "error" and not any(
            o.get("output_type") == "error" for o in cell.outputs
        ):
            cell.outputs.append(nbformat.v4.new_output("error", **TIMEOUT_ERROR))

    with tempfile.TemporaryDirectory(prefix="course-check-") as tmp:
        shutil.copy2(path, tmp)  # exercises read no files of their own: the notebook is enough
        nb = nbformat.read(Path(tmp) / path.name, as_version=4)
        kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=kernel,
            allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout=TIMEOUT_ERROR,
            on_cell_executed=record_timeout,
            resources={"metadata": {"path": tmp}},
            **({"km": km} if km is not None else {}),
        )
        # NBGRADER_EXECUTION: what nbgrader sets when it runs a notebook.
        kernel_env = {**os.environ, "NBGRADER_EXECUTION": "validate", **(env or {})}
        kernel_log = Path(tmp) / "kernel.log"  # the kernel's own start-up chatter, shown only if it dies
        try:
            with kernel_log.open("w") as log:
                # cleanup_kc: shut the kernel down also when the caller handed in its manager (km)
                client.execute(stderr=log, env=kernel_env, cleanup_kc=True)
        except NoSuchKernel as err:
            raise RuntimeError(
                f"No Jupyter kernel named {kernel!r} here ({err}). Run the check inside the course's "
                "environment: `make check NB=...`, or `python -m ipykernel install --user --name python3`."
            ) from err
        except Exception:
            print(kernel_log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
    return nb


def check_notebook(
    path: str | Path, timeout: int = CELL_TIMEOUT, env: dict[str, str] | None = None, km=None
) -> CheckReport:
    """Run ``path`` in a temporary copy and score its test cells as the autograder does (``env`` and
    ``km``: see ``execute_copy``)."""
    from nbgrader.utils import determine_grade

    path = Path(path)
    original = load_exercise(path)
    report = CheckReport(notebook=path, modified_cells=modified_locked_cells(original))
    start = time.perf_counter()
    nb = execute_copy(path, timeout, env, km)
    report.seconds = time.perf_counter() - start
    for cell in nb.cells:
        meta = _nbgrader_meta(cell)
        if cell.cell_type != "code" or not meta:
            continue
        grade_id = meta.get("grade_id", "?")
        if (seconds := cell_seconds(cell)) is not None:
            report.cell_seconds[grade_id] = seconds
        if meta.get("grade") and not meta.get("solution"):
            _drop_ignored_stderr(cell)  # first: determine_grade scores any stderr output 0 points
            points, max_points = determine_grade(cell)
            error = _error_line(cell) or (None if points == max_points else "wrote to stderr")
            report.tests.append(CellScore(grade_id, float(points or 0), float(max_points), error))
        elif meta.get("solution") and (error := _error_line(cell)):
            report.answer_errors[grade_id] = error
    return report


def _unsolved_hint(error: str) -> str:
    """A pointer for the release's placeholder: an answer (or a function a test calls) not written yet."""
    return "  <- not solved yet (まだ解答されていません)" if error.startswith("NotImplementedError") else ""


def _whole_message(head: str, error: str) -> list[str]:
    """``head`` and the error's first line, then every further line of it indented: the whole message,
    however long (a test's message says what went wrong and by how much; a cut one hides the numbers)."""
    first, *rest = error.splitlines() or [""]
    return [f"{head}{first}{_unsolved_hint(error)}", *(f"        {line}" for line in rest)]


def format_report(report: CheckReport) -> str:
    """The report as the lines the learner sees."""
    width = max([len(t.grade_id) for t in report.tests] + [10])
    lines = [
        f"Checked {report.notebook} in a temporary copy ({report.seconds:.0f} s); your file was not changed.",
        "",
    ]
    for t in report.tests:
        status = "PASS" if t.passed else "FAIL"
        line = f"  {status}  {t.grade_id:<{width}}  {t.points:g} / {t.max_points:g}"
        if t.error and not t.passed:
            lines += _whole_message(f"{line}   ", t.error)
        else:
            lines.append(line)
    if report.answer_errors:
        lines += ["", "Answer cells that raised an error (解答セルのエラー):"]
        for grade_id, error in report.answer_errors.items():
            lines += _whole_message(f"  {grade_id}: ", error)
    if report.modified_cells:
        lines += [
            "",
            "Read-only cells you edited (編集された読み取り専用セル): " + ", ".join(report.modified_cells),
            "  The autograder runs the original versions of these cells, not yours.",
        ]
    lines += [
        "",
        f"Score (点数): {report.score:g} / {report.max_score:g} points from the visible tests.",
        "Hidden tests also run when your instructor grades (採点時には隠しテストも実行されます).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.cli.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("notebook", type=Path, help="the exercise notebook to check")
    parser.add_argument(
        "--timeout", type=int, default=CELL_TIMEOUT, help="seconds per cell (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        report = check_notebook(args.notebook, args.timeout)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0 if report.full_marks else 1


if __name__ == "__main__":
    raise SystemExit(main())
