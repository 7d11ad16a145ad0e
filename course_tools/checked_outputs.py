"""Which checked outputs of the lessons differ on this machine: run them under nbval, report each cell.

    python -m course_tools.checked_outputs notebooks/*.ipynb      # one line per differing cell; exit 1

A cell tagged ``nbval-check-output`` must print what holds on every device (booleans, relations,
counts that do not depend on the device). ``scripts/gpu_check.sh`` runs this on a GPU, so its first run
names every checked cell that still depends on the device. It runs the suite's own nbval (the
repository's pytest settings: ``--nbval-lax``, the sanitizer, the message budget) on each notebook, in
place (nbval writes nothing back), and reads the cells' verdicts from a JUnit report.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CellDifference:
    notebook: str
    cell: str  # nbval's name for it: "Cell 12"
    detail: str  # the first lines of nbval's report: what was committed, what ran here

    def line(self) -> str:
        return f"{self.notebook} {self.cell}: {self.detail}"


ANSI = re.compile(r"(\x1b|#x1B)\[[0-9;]*m")  # colour codes, raw or as the JUnit XML escapes them


def _detail(message: str, lines: int = 4) -> str:
    """What differs, from nbval's report: the part after its "Traceback:" (the mismatch, committed ==
    here, or the exception), without colour codes, the cell's input or difflib's marker lines."""
    text = ANSI.sub("", message)
    text = text.split("Traceback:", 1)[1] if "Traceback:" in text else text
    text = text.split("Notebook cell execution failed", 1)[0]  # nbval repeats the report
    kept = [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip() and not ln.strip().startswith(("?", "assert reference_output"))
    ][:lines]
    return re.sub(r"\s+", " ", " | ".join(kept))[:400]


def differences(notebook: Path, timeout: int = 1800) -> tuple[int, list[CellDifference]]:
    """(cells nbval ran, the checked cells whose output differs or that raised) for one notebook."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(ROOT),
            f"--junitxml={report}",
            str(notebook.resolve()),
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if not report.is_file():
            raise RuntimeError(
                f"nbval did not run on {notebook}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        cases = ET.parse(report).getroot().iter("testcase")
        ran, found = 0, []
        for case in cases:
            ran += 1
            for verdict in ("failure", "error"):
                for node in case.findall(verdict):
                    text = (node.get("message") or "") + "\n" + (node.text or "")
                    found.append(CellDifference(notebook.name, case.get("name", "?"), _detail(text)))
        return ran, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.checked_outputs", description=__doc__)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per notebook")
    args = parser.parse_args(argv)
    total = 0
    for nb in args.notebooks:
        ran, found = differences(nb, args.timeout)
        total += len(found)
        print(f"FIGURE {nb.name}: {ran} cells run, {len(found)} checked cell(s) differ")
        for diff in found:
            print("DIFF", diff.line())
    return 1 if total else 0


if __name__ == "__main__":
    raise SystemExit(main())
