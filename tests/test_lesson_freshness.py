"""Committed lesson outputs cannot go stale silently.

* The stamp of a lesson covers the ``course_lib`` code it runs (``freshness.library_stamp``): a code
  change in any module a lesson imports, even indirectly, makes it stale; a comment does not.
* What a lesson writes to stderr is explained in ``tests/explained_stderr.toml``, in the committed
  outputs (here) and in the suite's fresh execution (``tests/plugins/nbval_stderr.py``, tried below).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_tools import freshness, nbtools

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
PLUGINS = ROOT / "tests" / "plugins"


def _notebook(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_committed_stderr_is_explained(path):
    nb = nbformat.read(path, as_version=4)
    unexplained = freshness.unexplained_stderr(nb, path.name)
    assert not unexplained, (
        f"{path.name} wrote to stderr what tests/explained_stderr.toml does not explain: {unexplained}"
    )


def test_every_explanation_is_still_needed():
    """Both ways: an explanation that matches no committed lesson output is stale and must go."""
    outputs = [
        (path.name, out.get("text", ""))
        for path in LESSONS
        for cell in nbformat.read(path, as_version=4).cells
        for out in cell.get("outputs", [])
        if out.get("name") == "stderr"
    ]
    for entry in freshness.explanations():
        assert any(freshness.is_explained(text, name, [entry]) for name, text in outputs), (
            f"tests/explained_stderr.toml explains {entry['pattern']!r}, which no lesson writes any more"
        )


def test_an_explanation_needs_a_reason(tmp_path):
    (tmp_path / "x.toml").write_text('[[stderr]]\npattern = "warn"\n')
    with pytest.raises(ValueError, match="pattern and a why"):
        freshness.explanations(tmp_path / "x.toml")


def test_a_lesson_runs_the_modules_it_imports_and_what_they_import():
    nb = _notebook("from course_lib.training.loop import train\nimport torch")
    modules = freshness.lesson_modules(nb)
    # imported by name, the packages above it, and what the loop's amp backend imports (two away)
    assert {"course_lib.training.loop", "course_lib.training", "course_lib"} <= set(modules)
    assert {"course_lib.training.amp", "course_lib.mixed_precision"} <= set(modules), modules
    assert "torch" not in modules and "course_tools.release" not in modules
    started = _notebook(
        '!python -m course_lib.cli.train --max-steps 2\nx = "course_lib.apparatus.local_sgd:run"'
    )
    assert {"course_lib.cli.train", "course_lib.apparatus.local_sgd"} <= set(
        freshness.lesson_modules(started)
    )


def test_a_code_change_in_an_imported_module_makes_the_outputs_stale_and_a_comment_does_not(tmp_path):
    shutil.copytree(ROOT / "course_lib", tmp_path / "course_lib", ignore=shutil.ignore_patterns("assets"))
    nb = _notebook("from course_lib import tables")
    nb.metadata["course"] = {"library": freshness.library_stamp(nb, tmp_path)}
    assert freshness.stale_modules(nb, tmp_path) == []
    loop = tmp_path / "course_lib" / "training" / "loop.py"  # not imported by tables: no effect
    loop.write_text(loop.read_text() + "\nX = 1\n")
    assert freshness.stale_modules(nb, tmp_path) == []
    tables = tmp_path / "course_lib" / "tables.py"
    source = tables.read_text()
    tables.write_text("# a comment\n" + source.replace('"""', '"""Docstring words. ', 1))
    assert freshness.stale_modules(nb, tmp_path) == [], "comments and docstrings change no output"
    tables.write_text(source + "\nTABLE_WIDTH = 80\n")
    assert freshness.stale_modules(nb, tmp_path) == ["course_lib.tables"]


def test_a_lesson_stamped_before_library_stamps_is_stale():
    nb = _notebook("x = 1")
    nb.cells[0].execution_count = 1
    nb.metadata["course"] = {"source_hash": nbtools.source_hash(nb)}
    assert "before the course_lib code it runs was stamped" in nbtools.stale_reason(nb)
    nb.metadata["course"]["library"] = freshness.library_stamp(nb)
    assert nbtools.stale_reason(nb) is None
    nb.metadata["course"]["library"]["torch"] = "0.0.1"
    assert "torch" in nbtools.stale_reason(nb)


def _run_nbval(folder: Path, nb: nbformat.NotebookNode, name: str) -> subprocess.CompletedProcess:
    (folder / "notebooks").mkdir()
    nbformat.write(nb, folder / "notebooks" / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "nbval_stderr", "-p", "no:cacheprovider", "--nbval-lax"]
        + ["--nbval-current-env", "-q", f"notebooks/{name}"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_fresh_execution_fails_on_an_unexplained_warning(tmp_path):
    explained = (
        "import sys\nprint('[transformers] DistilBertForSequenceClassification LOAD REPORT', file=sys.stderr)"
    )
    unexplained = "import warnings\nwarnings.warn('a new warning nobody explained')"
    (tmp_path / "a").mkdir()
    proc = _run_nbval(
        tmp_path / "a", _notebook(explained, unexplained, "print('ok')"), "01_device_placement.ipynb"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out and "a new warning nobody explained" in out, out
    (tmp_path / "b").mkdir()
    proc = _run_nbval(tmp_path / "b", _notebook(explained), "02_distributed_concepts.ipynb")
    assert proc.returncode == 1, "an explanation holds only for the lessons it names"
