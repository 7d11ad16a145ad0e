"""Repository-level promises: notebooks are fresh and clean, CI runs the README's command."""

import re
from pathlib import Path

import nbformat
import pytest

from course_tools import freshness, nbtools

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_lessons_are_numbered_in_order_from_00():
    # NN_ lessons count up from 00; an inserted lesson NNb_ (NNc_, ...) follows NN_ directly.
    main = [p.name[:3] for p in LESSONS if re.match(r"\d\d_", p.name)]
    assert main == [f"{i:02d}_" for i in range(len(main))]
    assert all(re.match(r"\d\d[b-z]?_", p.name) for p in LESSONS), "lesson names start NN_ or NNb_"
    names = [p.name[: p.name.index("_") + 1] for p in LESSONS]
    for i, name in enumerate(names):
        if len(name) == 4:  # NNx_: right after NN_ (x = b) or NN(x-1)_
            before = name[:2] + ("" if name[2] == "b" else chr(ord(name[2]) - 1)) + "_"
            assert i > 0 and names[i - 1] == before, f"{name} must follow {before}"
    assert len(LESSONS) >= 4, "the four lessons of the slides come first"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_outputs_belong_to_its_code(path):
    reason = nbtools.stale_reason(nbformat.read(path, as_version=4))
    assert reason is None, (
        f"{path.name} is stale: {reason}. Run `python -m course_tools.nbtools execute {path.relative_to(ROOT)}`."
    )


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_has_no_stray_metadata(path):
    nb = nbformat.read(path, as_version=4)
    assert set(nb.metadata) <= set(nbtools.KEEP_NOTEBOOK_METADATA)
    for cell in nb.cells:
        assert set(cell.metadata) <= set(nbtools.KEEP_CELL_METADATA), f"stray cell metadata in {path.name}"
    assert any("まとめ" in c.source for c in nb.cells if c.cell_type == "markdown"), (
        "a lesson ends with まとめ"
    )
    # the card, the checked cells' tags, the appendix: tests/test_lesson_shape.py


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme
    assert re.search(r"^(\w+=\S+ )*make test\s*$", ci, re.M)  # environment variables may come first


def test_torch_is_pinned_exactly_in_one_place():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch==2.13.0"' in pyproject
    assert "torch" not in (ROOT / "environment.yml").read_text().split("pip:")[1].replace("-e", "")


def test_clean_strips_editor_metadata():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"state": {}}
    nb.metadata["toc"] = {}
    cell = nbformat.v4.new_code_cell("1 + 1")
    cell.metadata.update({"collapsed": True, "execution": {"iopub.status.busy": "x"}, "tags": ["keep"]})
    nb.cells.append(cell)
    nbtools.clean(nb)
    assert set(nb.metadata) == {"kernelspec"}
    assert cell.metadata == {"tags": ["keep"]}


def test_clean_joins_a_print_the_kernel_sent_in_two_messages():
    cell = nbformat.v4.new_code_cell("print('a:', True)")
    stream = nbformat.v4.new_output
    cell.outputs = [
        stream("stream", name="stdout", text="a:"),
        stream("stream", name="stdout", text=" True\n"),
    ]
    cell.outputs.append(stream("stream", name="stderr", text="warn\n"))
    nbtools.clean(nbformat.v4.new_notebook(cells=[cell]))
    assert [(o.name, o.text) for o in cell.outputs] == [("stdout", "a: True\n"), ("stderr", "warn\n")]


def test_stale_reason_detects_edited_code():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", execution_count=1)])
    assert "never executed" in nbtools.stale_reason(nb)
    nb.metadata["course"] = {"source_hash": nbtools.source_hash(nb), "library": freshness.library_stamp(nb)}
    assert nbtools.stale_reason(nb) is None
    nb.cells[0].source = "x = 2"
    assert "changed" in nbtools.stale_reason(nb)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lessons_show_no_errors(path):
    """(stderr: tests/test_lesson_freshness.py, against tests/explained_stderr.toml)"""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"{path.name} cell {i} ends in {out.ename}: {out.evalue}"
