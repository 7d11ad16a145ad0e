"""course_tools.checked_outputs (what scripts/gpu_check.sh runs on a GPU): every checked cell whose output
differs on this machine is named, and nothing else; here with a fake device-dependent cell on a CPU."""

import nbformat
import pytest

from course_tools import checked_outputs


def _cell(source: str, output: str, checked: bool = False):
    cell = nbformat.v4.new_code_cell(source)
    if checked:  # the lessons' marker: nbval's cell tag
        cell.metadata["tags"] = ["nbval-check-output"]
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)]
    cell.execution_count = 1
    return cell


@pytest.mark.slow  # one kernel
def test_a_device_dependent_checked_cell_is_reported_and_the_others_are_not(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        _cell("print('same everywhere:', 2 + 2 == 4)", "same everywhere: True\n", checked=True),
        # committed on a GPU: the device's name in a checked cell
        _cell("import torch\nprint('device:', 'cpu')", "device: cuda\n", checked=True),
        _cell("import random\nprint(random.random())", "0.5\n"),  # unchecked: any output passes
    ]
    path = tmp_path / "fake_lesson.ipynb"
    nbformat.write(nb, path)
    ran, found = checked_outputs.differences(path, timeout=300)
    assert ran == 3
    assert [d.cell for d in found] == ["Cell 1"], [d.line() for d in found]  # nbval counts cells from 0
    assert "cuda" in found[0].detail and "cpu" in found[0].detail
    assert checked_outputs.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FIGURE fake_lesson.ipynb: 3 cells run, 1 checked cell(s) differ" in out and "DIFF" in out
    nb.cells[1].outputs[0].text = "device: cpu\n"  # committed on this machine: nothing differs
    nbformat.write(nb, path)
    assert checked_outputs.differences(path, timeout=300)[1] == []
