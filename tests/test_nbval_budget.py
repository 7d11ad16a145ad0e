"""The message budget of notebook cells (tests/plugins/nbval_budget.py) fails a flooding cell."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat

PLUGINS = Path(__file__).resolve().parent / "plugins"


def run_nbval(tmp_path: Path, *cells: str) -> subprocess.CompletedProcess:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "cells.ipynb")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "nbval_budget", "-p", "no:cacheprovider", "--nbval-lax"]
        + ["--nbval-current-env", "-q", "cells.ipynb"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_cell_that_floods_the_channel_fails_and_a_quiet_one_passes(tmp_path):
    flood = "from IPython.display import display\nfor i in range(400):\n    display(i)"
    quiet = "for i in range(400):\n    x = i\nprint(x)"
    proc = run_nbval(tmp_path, quiet, flood)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "budget 300" in out and "Cell 1" in out, out
