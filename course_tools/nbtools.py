"""Notebook maintenance: execute lessons in place, strip stray metadata, detect stale outputs.

    python -m course_tools.nbtools execute notebooks/01_device_placement.ipynb   # run, clean, stamp
    python -m course_tools.nbtools clean solutions/*/*.ipynb                     # metadata only
    python -m course_tools.nbtools check notebooks/*.ipynb                       # stale? (exit 1)
    python -m course_tools.nbtools execute notebooks/*.ipynb --readme README.md  # also record run times
    python -m course_tools.nbtools render notebooks/*.ipynb --readme README.md   # re-render, no running
    python -m course_tools.nbtools render notebooks/*.ipynb --readme README.md --check  # drift? (exit 1)
    python -m course_tools.nbtools moved notebooks/03*.ipynb --base HEAD~3   # checked outputs kept? (exit 1)

``execute`` stamps ``metadata.course``: ``source_hash``, a hash of every code cell's source at the
time the outputs were produced, and ``library``, a fingerprint of every ``course_lib`` module the
lesson runs and of the pinned libraries' versions (``freshness.library_stamp``). ``check`` (and the
test suite) fails when either changed after that, i.e. when the committed outputs no longer belong to
the code that produced them. ``execute`` also fails (exit 1, outputs kept) when a cell wrote to stderr
something that ``tests/explained_stderr.toml`` does not explain.

Run times: ``execute --readme README.md`` records each notebook's seconds, machine and date in
``docs/results/lessons.json`` (``--json`` for another path), then renders from that record the
run-time column of README's lesson table (between ``<!-- lessons:start -->`` and
``<!-- lessons:end -->``) and the run-time sentence of each lesson (one markdown cell holds it: the
"実行環境" cell at the end, out of the learner's first screen)
(``RUNTIME_SENTENCE``, e.g. ``CPU（2 コア）で約 5 秒（計測: 2026-11-30、README の表と同じ値）``).
``render`` does the same from the record without running anything; ``render --check`` only compares.
A markdown edit leaves ``source_hash`` alone, so the outputs stay fresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import nbformat

from course_tools import freshness, sections

# "summary": a lesson's English summary (the site and the README read it; the learner's first screen is
# the Japanese card). A cell's "jupyter" metadata keeps only "source_hidden": a 確認 cell's code is collapsed.
KEEP_NOTEBOOK_METADATA = ("kernelspec", "language_info", "nbgrader", "course", "summary")
KEEP_CELL_METADATA = ("nbgrader", "tags", "jupyter")
KEEP_JUPYTER_CELL_METADATA = ("source_hidden",)
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LESSONS = "lessons"  # README block: the lesson table
LESSONS_RECORD = Path("docs/results/lessons.json")
RENDER_COMMAND = "python -m course_tools.nbtools render notebooks/*.ipynb --readme README.md"
MEASURE_COMMAND = "python -m course_tools.nbtools execute notebooks/*.ipynb --readme README.md"
# The sentence that states a lesson's run time (in its 実行環境 cell at the end); the writer owns it.
RUNTIME_SENTENCE = re.compile(
    r"(?:\S+ と )?CPU(?:（\d+ コア）| )で約 \d+ 秒（計測: [^、）]*、README の表と同じ値）"
)
LESSONS_ABOUT = (
    "Run time of each lesson notebook (seconds, date, machine), written by `python -m course_tools.nbtools "
    "execute notebooks/*.ipynb --readme README.md`. README's lesson table and each lesson's run-time sentence "
    "are rendered from it; `python -m course_tools.nbtools render notebooks/*.ipynb --readme README.md` renders "
    "them again without running anything. See docs/results/README.md."
)
_LESSON_ROW = re.compile(r"\| `notebooks/([^`]+)` \|")
_FOOTER = "Run times measured by `python -m course_tools.nbtools execute` on "


def source_hash(nb: nbformat.NotebookNode) -> str:
    """SHA-256 over the sources of all code cells, in order."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def coalesce_streams(outputs: list) -> list:
    """Consecutive stdout (or stderr) outputs as one: how a print shows, however the kernel split it."""
    merged: list = []
    for out in outputs:
        last = merged[-1] if merged else None
        if out.get("output_type") == "stream" and last and last.get("output_type") == "stream":
            if last.get("name") == out.get("name"):
                last["text"] = "".join(last["text"]) + "".join(out["text"])  # timing split it: one text
                continue
        merged.append(out)
    return merged


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop metadata that editors add (widget state, timings, collapsed flags), keep the rest."""
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEEP_NOTEBOOK_METADATA}
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    if "language_info" in nb.metadata:
        nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        shown = {k: v for k, v in cell.metadata.get("jupyter", {}).items() if k in KEEP_JUPYTER_CELL_METADATA}
        cell.metadata.pop("jupyter", None)
        if shown.get("source_hidden"):
            cell.metadata["jupyter"] = {"source_hidden": True}
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.get("outputs", []))
            for out in cell.outputs:
                out.get("metadata", {}).pop("execution", None)
                # Widget views (progress bars, explorers) need the live kernel; their text fallback
                # would show a bar frozen at 0 %, so a note replaces it.
                data = out.get("data", {})
                if "application/vnd.jupyter.widget-view+json" in data:
                    data.pop("application/vnd.jupyter.widget-view+json")
                    data["text/plain"] = (
                        "(interactive widget or progress bar: run the notebook to see it live)"
                    )
    return nb


def execute(path: Path, timeout: int = 600) -> float:
    """Run ``path`` top to bottom in its own folder, save outputs in place; return seconds taken."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    seconds = time.perf_counter() - start
    clean(nb)
    nb.metadata["course"] = {"source_hash": source_hash(nb), "library": freshness.library_stamp(nb)}
    nbformat.write(nb, path)
    return seconds


CHECK_TAG = "nbval-check-output"  # nbval's cell tag for a cell whose output the regression tests compare


def checked_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """The outputs the regression tests compare, one text per checked cell (tag or nbval's old comment)."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if CHECK_TAG in cell.metadata.get("tags", []) or cell.source.startswith("# NBVAL_CHECK_OUTPUT"):
            parts = []
            for out in coalesce_streams([dict(o) for o in cell.get("outputs", [])]):
                if out.get("output_type") == "stream":
                    parts.append("".join(out.get("text", "")))
                elif "text/plain" in out.get("data", {}):
                    parts.append("".join(out["data"]["text/plain"]))
            texts.append("".join(parts))
    return texts


def moved_outputs(before: nbformat.NotebookNode, after: nbformat.NotebookNode) -> list[str]:
    """Lines printed by checked cells of ``before`` that no checked cell of ``after`` prints (a restructure
    moves cells and gathers verdicts in 確認 cells; the lines they print stay, unless reworded on purpose)."""
    left: dict[str, int] = {}
    for text in checked_outputs(after):
        for line in text.splitlines():
            left[line] = left.get(line, 0) + 1
    missing = []
    for text in checked_outputs(before):
        for line in text.splitlines():
            if left.get(line, 0) > 0:
                left[line] -= 1
            elif line.strip():
                missing.append(line)
    return missing


def stale_reason(nb: nbformat.NotebookNode) -> str | None:
    """Why the committed outputs do not belong to the code (None when they do)."""
    stamped = nb.metadata.get("course", {}).get("source_hash")
    if stamped is None:
        return "it was never executed with `python -m course_tools.nbtools execute`"
    if stamped != source_hash(nb):
        return "its code changed after its outputs were produced"
    changed = freshness.stale_modules(nb)
    if changed is None:
        return "it was executed before the course_lib code it runs was stamped"
    if changed:
        return f"what it runs changed after its outputs were produced: {', '.join(changed)}"
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    if counts != list(range(1, len(counts) + 1)):
        return "its cells were not run once each, top to bottom, in a fresh kernel"
    return None


def machine_info() -> dict[str, Any]:
    """This machine as a run-time record stores it: CPU name, cores, the device the lessons use."""
    from course_lib.devices import cpu_name, get_device

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "device": str(get_device())}


def record_run_times(
    record: dict[str, Any], seconds: dict[str, float], machine: dict[str, Any], date: str
) -> dict[str, Any]:
    """``record`` with the entries of the notebooks in ``seconds`` (file name: seconds) replaced."""
    notebooks = dict(record.get("notebooks", {}))
    for name, value in seconds.items():
        notebooks[name] = {"seconds": round(value, 1), "date": date, **machine}
    return {**record, "about": LESSONS_ABOUT, "notebooks": notebooks}


def _machine_text(entry: dict[str, Any]) -> str:
    parts = [entry.get("cpu"), entry.get("cores") and f"{entry['cores']} cores"]
    parts.append(entry.get("device") and f"device {entry['device']}")
    return ", ".join(p for p in parts if p)


def _footer(entries: dict[str, dict[str, Any]]) -> str:
    """The line under the table: machine and date(s) of the run times above it."""
    by_machine: dict[str, list[str]] = {}
    for entry in entries.values():
        by_machine.setdefault(_machine_text(entry), []).append(entry.get("date", "date unknown"))
    if len(by_machine) == 1:
        ((machine, dates),) = by_machine.items()
        return _FOOTER + ", ".join(p for p in (machine, *sorted(set(dates))) if p) + "."
    runs = [f"{m}, {', '.join(sorted(set(d)))}" for m, d in by_machine.items()]
    return _FOOTER + "; ".join(runs) + "."


def render_lessons_table(body: str, record: dict[str, Any], where: str = "README.md") -> str:
    """The lesson block ``body`` with its run-time column and footer line rendered from ``record``.

    The lesson column and the description are written by hand and kept; every row's notebook must
    have an entry in the record and every entry a row.
    """
    notebooks = record.get("notebooks", {})
    lines, seen = [], {}
    for line in body.splitlines():
        match = _LESSON_ROW.match(line)
        if match:
            name = match.group(1)
            if name not in notebooks:
                raise sections.SectionError(
                    f"{where} lists notebooks/{name} but its record has no run time for it: run "
                    f"`python -m course_tools.nbtools execute notebooks/{name} --readme README.md`."
                )
            cells = line.rstrip().rstrip("|").split("|")
            cells[-1] = f" {notebooks[name]['seconds']:.0f} s "
            line = "|".join(cells) + "|"
            seen[name] = notebooks[name]
        elif line.startswith(_FOOTER[:16]):
            continue
        lines.append(line)
    missing = [name for name in notebooks if name not in seen]
    if missing:
        raise sections.SectionError(
            f"the run-time record has notebooks/{missing[0]} but the lesson table in {where} has no row "
            f"for it: add a row '| `notebooks/{missing[0]}` | what it shows | |' to the table, then run "
            f"`{RENDER_COMMAND}`."
        )
    while lines and not lines[-1].strip():
        lines.pop()
    # A blank line ends the table: without it markdown shows the footer as one more table row.
    return "\n".join([*lines, "", _footer(seen)]) + "\n"


def runtime_sentence(entry: dict[str, Any]) -> str:
    """The run-time sentence of a lesson header, e.g. ``CPU（2 コア）で約 5 秒（計測: 2026-11-30、...）``."""
    cpu = f"CPU（{entry['cores']} コア）" if entry.get("cores") else "CPU "
    if entry.get("device", "cpu") != "cpu":
        cpu = f"{entry['device']} と {cpu}"
    return f"{cpu}で約 {entry['seconds']:.0f} 秒（計測: {entry.get('date', '')}、README の表と同じ値）"


def render_header(nb: nbformat.NotebookNode, entry: dict[str, Any], where: str = "the notebook") -> bool:
    """Put ``runtime_sentence(entry)`` in the one markdown cell that states the lesson's run time; return
    whether it changed."""
    cells = [c for c in nb.cells if c.cell_type == "markdown" and RUNTIME_SENTENCE.search(c.source)]
    found = sum(len(RUNTIME_SENTENCE.findall(c.source)) for c in cells)
    if found != 1:
        raise sections.SectionError(
            f"{where}: exactly one markdown cell needs one run-time sentence like "
            f"'{runtime_sentence({'cores': 2, 'seconds': 5, 'date': '2026-11-30', 'device': 'cpu'})}' "
            f"(found {found}): write one where the lesson states its run time (its 実行環境 cell at the "
            f"end), then run `{RENDER_COMMAND}`."
        )
    cell = cells[0]
    new = RUNTIME_SENTENCE.sub(runtime_sentence(entry), cell.source)
    changed = new != cell.source
    cell.source = new
    return changed


def render_run_times(
    record: dict[str, Any],
    readme: Path | None,
    notebooks: list[Path],
    check: bool = False,
    fix: str = RENDER_COMMAND,
) -> list[str]:
    """Render README's lesson table and each notebook's header sentence from ``record``.

    With ``check``, nothing is written: the returned list says what differs (empty: up to date).
    Without it, the files are rewritten where they differ (markdown only; cell ids, metadata and the
    code's ``source_hash`` are untouched) and the list is empty.
    """
    problems = []
    if readme is not None:
        body = sections.read_block(readme, LESSONS)
        rendered = render_lessons_table(body, record, str(readme))
        if check:
            problems.append(sections.check_block(readme, LESSONS, rendered, fix))
        else:
            sections.write_block(readme, LESSONS, rendered)
    entries = record.get("notebooks", {})
    for path in notebooks:
        if path.name not in entries:
            raise sections.SectionError(
                f"{path}: no run time recorded for it: run "
                f"`python -m course_tools.nbtools execute {path} --readme README.md`."
            )
        nb = nbformat.read(path, as_version=4)
        if render_header(nb, entries[path.name], str(path)):
            if check:
                problems.append(
                    f"{path}: its run-time sentence differs from the record "
                    f"('{runtime_sentence(entries[path.name])}'). Re-render it with `{fix}` (no running)."
                )
            else:
                nbformat.write(nb, path)
    return [p for p in problems if p]


def check_committed(root: Path = Path(".")) -> list[str]:
    """Drift of README's lesson table and of every lesson header against ``docs/results/lessons.json``."""
    record = sections.load_record(root / LESSONS_RECORD, MEASURE_COMMAND)
    notebooks = sorted((root / "notebooks").glob("[0-9]*.ipynb"))
    return render_run_times(record, root / "README.md", notebooks, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["execute", "clean", "check", "render", "moved"])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (execute)")
    parser.add_argument(
        "--readme",
        type=Path,
        help="execute: record run times and render them into this README; render: the README",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=LESSONS_RECORD,
        help=f"execute --readme: the record to update (default {LESSONS_RECORD})",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=LESSONS_RECORD,
        help=f"render: the record to render from (default {LESSONS_RECORD})",
    )
    parser.add_argument("--check", action="store_true", help="render: only compare, exit 1 on drift")
    parser.add_argument("--base", default="HEAD", help="moved: the git revision to compare with")
    args = parser.parse_args(argv)
    if args.check and args.command != "render":
        parser.error("--check goes with render (the stale-output check is the `check` command)")
    status, times = 0, {}
    for path in args.paths:
        if not path.is_file():
            print(f"{path}: no such notebook", file=sys.stderr)
            status = 2
            continue
        if args.command == "execute":
            seconds = times[path.name] = execute(path, args.timeout)
            print(json.dumps({"notebook": str(path), "seconds": round(seconds, 1)}))
            unexplained = freshness.unexplained_stderr(nbformat.read(path, as_version=4), path.name)
            for line in unexplained:
                print(
                    f"{path}: unexplained stderr in {line}\n  Silence it in the lesson, or explain it in "
                    f"{freshness.EXPLAINED_STDERR.relative_to(freshness.ROOT)} (pattern, why, lessons).",
                    file=sys.stderr,
                )
            status = max(status, 1 if unexplained else 0)
        elif args.command == "clean":
            nb = clean(nbformat.read(path, as_version=4))
            nbformat.write(nb, path)
        elif args.command == "moved":
            import subprocess

            shown = subprocess.run(
                ["git", "show", f"{args.base}:{path.as_posix()}"], capture_output=True, text=True, check=True
            ).stdout
            before, after = nbformat.reads(shown, as_version=4), nbformat.read(path, as_version=4)
            missing = moved_outputs(before, after)
            print(
                f"{path}: {len(checked_outputs(before))} checked cells at {args.base}, "
                f"{len(checked_outputs(after))} now; {len(missing)} line(s) not printed by a checked cell now"
            )
            for text in missing:
                print("  MISSING:", text[:300])
            status = max(status, 1 if missing else 0)
        elif args.command == "check":
            reason = stale_reason(nbformat.read(path, as_version=4))
            if reason:
                print(f"{path}: stale: {reason}. Run `python -m course_tools.nbtools execute {path}`.")
                status = 1
    notebooks = [p for p in args.paths if p.is_file()]
    try:
        if args.command == "execute" and args.readme and times:
            record = sections.load_record(args.json, MEASURE_COMMAND) if args.json.is_file() else {}
            record = record_run_times(record, times, machine_info(), time.strftime("%Y-%m-%d"))
            sections.write_record(args.json, record)
            render_run_times(record, args.readme, notebooks)
        elif args.command == "render":
            record = sections.load_record(args.from_json, MEASURE_COMMAND)
            fix = f"python -m course_tools.nbtools render {' '.join(map(str, args.paths))}"
            fix += f" --readme {args.readme}" if args.readme else ""
            fix += f" --from-json {args.from_json}" if args.from_json != LESSONS_RECORD else ""
            problems = render_run_times(record, args.readme, notebooks, check=args.check, fix=fix)
            for problem in problems:
                print(problem, file=sys.stderr)
            status = max(status, 1 if problems else 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
