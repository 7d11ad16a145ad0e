"""Notebook maintenance: execute lessons in place, strip stray metadata, detect stale outputs.

    python -m course_lib.nbtools execute notebooks/01_device_placement.ipynb   # run, clean, stamp
    python -m course_lib.nbtools clean solutions/*/*.ipynb                     # metadata only
    python -m course_lib.nbtools check notebooks/*.ipynb                       # stale? (exit 1)
    python -m course_lib.nbtools execute notebooks/*.ipynb --readme README.md  # also record run times

``execute`` stamps ``metadata.course.source_hash``: a hash of every code cell's source at the time
the outputs were produced. ``check`` (and the test suite) fails when code changed after that, i.e.
when the committed outputs no longer belong to the code beside them.
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

import nbformat

KEEP_NOTEBOOK_METADATA = ("kernelspec", "language_info", "nbgrader", "course")
KEEP_CELL_METADATA = ("nbgrader", "tags")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def source_hash(nb: nbformat.NotebookNode) -> str:
    """SHA-256 over the sources of all code cells, in order."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop metadata that editors add (widget state, timings, collapsed flags), keep the rest."""
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEEP_NOTEBOOK_METADATA}
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    if "language_info" in nb.metadata:
        nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
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
    nb.metadata["course"] = {"source_hash": source_hash(nb)}
    nbformat.write(nb, path)
    return seconds


def stale_reason(nb: nbformat.NotebookNode) -> str | None:
    """Why the committed outputs do not belong to the code (None when they do)."""
    stamped = nb.metadata.get("course", {}).get("source_hash")
    if stamped is None:
        return "it was never executed with `python -m course_lib.nbtools execute`"
    if stamped != source_hash(nb):
        return "its code changed after its outputs were produced"
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    if counts != list(range(1, len(counts) + 1)):
        return "its cells were not run once each, top to bottom, in a fresh kernel"
    return None


def record_run_times(readme: Path, seconds: dict[str, float], machine: str) -> None:
    """Write measured run times into the last column of README's lesson table (between markers)."""
    text = readme.read_text()
    start, end = text.index("<!-- lessons:start -->"), text.index("<!-- lessons:end -->")
    rows = []
    for line in text[start:end].splitlines():
        match = re.match(r"\| `notebooks/([^`]+)` \|", line)
        if match and match.group(1) in seconds:
            cells = line.rstrip().rstrip("|").split("|")
            cells[-1] = f" {seconds[match.group(1)]:.0f} s "
            line = "|".join(cells) + "|"
        elif line.startswith("Run times measured"):
            continue
        rows.append(line)
    rows.append(f"Run times measured by `python -m course_lib.nbtools execute` on {machine}.")
    readme.write_text(text[:start] + "\n".join(rows) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["execute", "clean", "check"])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (execute)")
    parser.add_argument("--readme", type=Path, help="with execute: record run times in this README")
    args = parser.parse_args(argv)
    status, times = 0, {}
    for path in args.paths:
        if not path.is_file():
            print(f"{path}: no such notebook", file=sys.stderr)
            status = 2
            continue
        if args.command == "execute":
            seconds = times[path.name] = execute(path, args.timeout)
            print(json.dumps({"notebook": str(path), "seconds": round(seconds, 1)}))
        elif args.command == "clean":
            nb = clean(nbformat.read(path, as_version=4))
            nbformat.write(nb, path)
        else:
            reason = stale_reason(nbformat.read(path, as_version=4))
            if reason:
                print(f"{path}: stale: {reason}. Run `python -m course_lib.nbtools execute {path}`.")
                status = 1
    if args.readme and times:
        from course_lib.devices import cpu_name, get_device

        machine = f"{cpu_name()}, {os.cpu_count()} cores, device {get_device()}, {time.strftime('%Y-%m-%d')}"
        record_run_times(args.readme, times, machine)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
