"""Generate the student release exercises/ from the nbgrader source solutions/, and check it for drift.

    python -m course_tools.release                     # regenerate exercises/ for every assignment
    python -m course_tools.release 02_distributed_concepts
    python -m course_tools.release --check             # exit 1 if exercises/ is stale against solutions/
    python -m course_tools.release --answers 00_intro --out DIR   # the release with the reference answers filled in

Run it from the course root (the folder with nbgrader_config.py) or pass --root. nbgrader's
generate_assignment runs in a temporary copy without a gradebook, so this never touches gradebook.db
(record an assignment for grading with `nbgrader generate_assignment NAME --force`, see the instructor
guide). --check compares cells (type, source, nbgrader metadata), not bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = "solutions"
RELEASE = "exercises"
CONFIG = "nbgrader_config.py"
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def check_course_root(root: Path) -> Path:
    """``root`` as an absolute path; raise a clear error if it is not the course root."""
    root = Path(root).resolve()
    missing = [name for name in (SOURCE, CONFIG) if not (root / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not the course root (it has no {' or '.join(missing)}). Run this from the "
            "repository root, or pass --root PATH."
        )
    return root


def find_assignments(root: Path) -> list[str]:
    """Names of the assignments in ``solutions/`` (folders holding a notebook)."""
    source = Path(root) / SOURCE
    return sorted(d.name for d in source.iterdir() if d.is_dir() and any(d.glob("*.ipynb")))


def _check_names(root: Path, assignments: list[str] | None) -> list[str]:
    known = find_assignments(root)
    if not assignments:
        return known
    unknown = sorted(set(assignments) - set(known))
    if unknown:
        raise ValueError(f"Unknown assignment(s) {', '.join(unknown)}: choose from {', '.join(known)}.")
    return list(assignments)


def generate(root: Path, assignments: list[str], dest: Path) -> None:
    """Run ``nbgrader generate_assignment`` (no gradebook) for ``assignments``; write them to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="course-release-") as tmp:
        course = Path(tmp)
        shutil.copy2(root / CONFIG, course / CONFIG)
        for name in assignments:
            shutil.copytree(
                root / SOURCE / name,
                course / SOURCE / name,
                ignore=shutil.ignore_patterns(".ipynb_checkpoints"),
            )
        cmd = [sys.executable, "-m", "nbgrader", "generate_assignment", "*", "--force", "--no-db"]
        done = subprocess.run(cmd, cwd=course, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nbgrader generate_assignment failed:\n{done.stdout}\n{done.stderr}")
        for name in assignments:
            built = course / RELEASE / name
            if not built.is_dir():
                raise RuntimeError(f"nbgrader wrote no release for {name}:\n{done.stderr[-3000:]}")
            shutil.copytree(built, dest / name)


def notebook_signature(path: Path) -> list[tuple[str, str, str]]:
    """What a release notebook is made of: (cell type, source, nbgrader metadata) per cell."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return [
        (c.cell_type, c.source, json.dumps(c.metadata.get("nbgrader", {}), sort_keys=True)) for c in nb.cells
    ]


def compare(expected: Path, actual: Path) -> list[str]:
    """Differences between a freshly generated release and the committed one (empty: up to date)."""

    def files(folder: Path) -> set[str]:
        if not folder.is_dir():
            return set()
        return {
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            if p.is_file() and ".ipynb_checkpoints" not in p.parts
        }

    problems = []
    want, have = files(expected), files(actual)
    problems += [f"{actual / name}: missing" for name in sorted(want - have)]
    problems += [f"{actual / name}: not generated from {SOURCE}/ (stale)" for name in sorted(have - want)]
    for name in sorted(want & have):
        if not name.endswith(".ipynb"):
            if (expected / name).read_bytes() != (actual / name).read_bytes():
                problems.append(f"{actual / name}: differs")
            continue
        new, old = notebook_signature(expected / name), notebook_signature(actual / name)
        if len(new) != len(old):
            problems.append(f"{actual / name}: {len(old)} cells, the source gives {len(new)}")
            continue
        for i, (a, b) in enumerate(zip(new, old)):
            if a != b:
                what = ["cell type", "source", "nbgrader metadata"][next(k for k in range(3) if a[k] != b[k])]
                grade_id = json.loads(a[2]).get("grade_id", f"#{i}")
                problems.append(f"{actual / name}: cell {i} ({grade_id}): {what} differs")
    return problems


def write_release(root: Path, assignments: list[str] | None = None) -> list[str]:
    """Regenerate ``exercises/<assignment>`` from ``solutions/``; return the assignments written."""
    root = check_course_root(root)
    names = _check_names(root, assignments)
    with tempfile.TemporaryDirectory(prefix="course-release-out-") as tmp:
        generate(root, names, Path(tmp))
        for name in names:
            target = root / RELEASE / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(Path(tmp) / name, target)
    if not assignments:  # a full release: drop exercises whose source is gone
        for stale in (root / RELEASE).iterdir():
            if stale.is_dir() and stale.name not in names:
                shutil.rmtree(stale)
    return names


def check_release(root: Path, assignments: list[str] | None = None) -> list[str]:
    """Why ``exercises/`` is stale against ``solutions/`` (empty list: up to date)."""
    root = check_course_root(root)
    names = _check_names(root, assignments)
    problems = []
    with tempfile.TemporaryDirectory(prefix="course-release-check-") as tmp:
        generate(root, names, Path(tmp))
        for name in names:
            problems += compare(Path(tmp) / name, root / RELEASE / name)
    if not assignments:
        release = root / RELEASE
        extra = (
            sorted(d.name for d in release.iterdir() if d.is_dir() and d.name not in names)
            if release.is_dir()
            else []
        )
        problems += [f"{release / name}: no source in {SOURCE}/ (stale)" for name in extra]
    return problems


def strip_solution_markers(source: str) -> str:
    """A solution cell's source without its ``### BEGIN/END SOLUTION`` lines: the reference answer."""
    return "\n".join(line for line in source.splitlines() if line.strip() not in SOLUTION_MARKERS)


def fill_answers(release_nb, source_nb):
    """A copy of the release notebook with every answer cell holding the reference solution."""
    answers = {
        c.metadata["nbgrader"]["grade_id"]: strip_solution_markers(c.source)
        for c in source_nb.cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    filled = copy.deepcopy(release_nb)
    for cell in filled.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            if meta["grade_id"] not in answers:
                raise KeyError(f"answer cell {meta['grade_id']!r} has no counterpart in the source notebook")
            cell.source = answers[meta["grade_id"]]
    return filled


def write_answers(root: Path, assignment: str, out: Path) -> Path:
    """Write ``out/<assignment>.ipynb``: the committed release filled in with the reference answers."""
    import nbformat

    root = check_course_root(root)
    name = _check_names(root, [assignment])[0]
    release = root / RELEASE / name / f"{name}.ipynb"
    if not release.is_file():
        raise FileNotFoundError(
            f"No release at {release}: run `python -m course_tools.release {name}` first."
        )
    source = nbformat.read(root / SOURCE / name / f"{name}.ipynb", as_version=4)
    filled = fill_answers(nbformat.read(release, as_version=4), source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(filled, out / release.name)
    return out / release.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.release",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("assignments", nargs="*", help="assignment names (default: all in solutions/)")
    parser.add_argument("--root", type=Path, default=Path("."), help="the course root (default: here)")
    parser.add_argument("--check", action="store_true", help="only check that exercises/ is up to date")
    parser.add_argument(
        "--answers", metavar="ASSIGNMENT", help="write the release with the reference answers"
    )
    parser.add_argument("--out", type=Path, help="folder for --answers")
    args = parser.parse_args(argv)
    try:
        if args.answers:
            if args.out is None:
                parser.error("--answers needs --out FOLDER")
            print(f"wrote {write_answers(args.root, args.answers, args.out)}")
            return 0
        if args.check:
            problems = check_release(args.root, args.assignments)
            if problems:
                print(f"{RELEASE}/ is stale against {SOURCE}/:", *problems, sep="\n  ")
                print(
                    "Regenerate it with `make release` (python -m course_tools.release) and commit the result."
                )
                return 1
            print(f"{RELEASE}/ is up to date with {SOURCE}/.")
            return 0
        names = write_release(args.root, args.assignments)
        print(f"wrote {RELEASE}/ for {', '.join(names)}")
        return 0
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
