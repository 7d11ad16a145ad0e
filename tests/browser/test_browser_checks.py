"""The tier's checks catch what they are for: broken explorers, errors, tracebacks, missing images.

Each test runs a small notebook written here into the course copy, with deliberate faults, and asserts
that the same checks the lesson tests use report every fault; the working parts (the kernel's network
guard, a tqdm progress bar drawn as a widget, the course's explorer) must pass them.
"""

from __future__ import annotations

import json

import pytest
from browser_lab import (
    check_explorer,
    explorers,
    notebook_problems,
    open_notebook,
    run_all,
    save,
    skip_module_unless_available,
)

skip_module_unless_available()
pytestmark = pytest.mark.slow  # JupyterLab in Chromium: tens of seconds per test


def write_notebook(path, *sources: str) -> None:
    cells = [
        {
            "cell_type": "code",
            "execution_count": None,
            "id": f"c{i}",
            "metadata": {},
            "outputs": [],
            "source": s,
        }
        for i, s in enumerate(sources)
    ]
    kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb = {"cells": cells, "metadata": {"kernelspec": kernelspec}, "nbformat": 4, "nbformat_minor": 5}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


KERNEL_IS_GUARDED = """\
import os, socket
assert os.environ["HF_HUB_OFFLINE"] == "1", "kernel not offline"
assert socket.socket.connect.__name__ == "_guarded_connect", "kernel without the network guard"
print("offline, network guarded")"""

PROGRESS_BAR = """\
from tqdm.auto import tqdm  # as the course's training loop draws its progress bar
for _ in tqdm(range(200), desc="train"):
    pass"""

WORKING = """\
from course_lib import widgets
widgets.precision_explorer("1e-8")"""

ENTER_ONLY = """\
enter_only = widgets.precision_explorer("1e-8")
enter_only.children[0].children[0].continuous_update = False  # updates on Enter only
enter_only"""

BROKEN_CALLBACK = """\
import importlib.util
spec = importlib.util.spec_from_file_location("broken_widgets", widgets.__file__)
broken_widgets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(broken_widgets)  # a private copy: the other explorers keep working
calls = 0
def explain_number(text, scale=1.0):
    global calls
    calls += 1
    if calls > 1:
        raise RuntimeError("deliberately broken explorer callback")
    return widgets.explain_number(text, scale)
broken_widgets.explain_number = explain_number
broken_widgets.precision_explorer("1e-8")"""


def test_widgets_work_and_the_explorer_check_catches_broken_explorers(page, lab):
    path = "browser-checks/explorers.ipynb"
    write_notebook(lab.course / path, KERNEL_IS_GUARDED, PROGRESS_BAR, WORKING, ENTER_ONLY, BROKEN_CALLBACK)
    open_notebook(page, lab, path)
    run_all(page, timeout_s=120)
    save(page, lab.course / path)
    assert not notebook_problems(page, saved=lab.course / path)
    # tqdm draws a widget here (lesson 01's training bars: COURSE_BROWSER_TESTS=full), not text.
    assert page.locator(".jp-NotebookPanel .widget-hprogress .progress-bar-success").count() == 1
    found = explorers(page)
    assert found.count() == 3
    check_explorer(found.nth(0))  # the course's explorer, as the lesson shows it
    with pytest.raises(AssertionError, match=r"70000 was typed \(no Enter\), but its output did not follow"):
        check_explorer(found.nth(1), timeout_ms=3_000)
    with pytest.raises(AssertionError, match="precision explorer: 70000 was typed"):
        check_explorer(found.nth(2), timeout_ms=3_000)


def test_run_all_check_catches_errors_tracebacks_and_broken_images(page, lab):
    path = "browser-checks/faults.ipynb"
    write_notebook(
        lab.course / path,
        "import sys, traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.print_exc()",
        "from IPython.display import HTML\nHTML('<img src=\"no-such-image.png\">')",
        "raise ValueError('deliberate')",
        "print('never reached')",
    )
    open_notebook(page, lab, path)
    run_all(page, timeout_s=120)
    save(page, lab.course / path)
    problems = "\n".join(notebook_problems(page, saved=lab.course / path))
    assert "code cell 1 shows a traceback" in problems
    assert "code cell 2: an image did not load" in problems
    assert "code cell 3 raised ValueError: deliberate" in problems
    assert "code cell(s) 4 of 4 did not run" in problems
