"""The lessons in JupyterLab: Run All ends clean, plots load, widgets render and respond."""

from __future__ import annotations

import pytest
from browser_lab import (
    ROOT,
    check_explorer,
    explorers,
    notebook_problems,
    open_notebook,
    run_all,
    save,
    skip_module_unless_available,
    tier_mode,
)

skip_module_unless_available()
pytestmark = pytest.mark.slow  # JupyterLab in Chromium: tens of seconds per test


def run_lesson(page, lab, name: str, timeout_s: float) -> list[str]:
    path = f"notebooks/{name}.ipynb"
    open_notebook(page, lab, path)
    run_all(page, timeout_s)
    save(page, lab.course / path)
    return notebook_problems(page, saved=lab.course / path, committed=ROOT / path)


def test_lesson_00_runs_clean(page, lab):
    problems = run_lesson(page, lab, "00_intro", timeout_s=120)
    assert not problems, "\n".join(problems)


FULL_ONLY = pytest.mark.skipif(
    tier_mode() != "full",
    reason="long lessons in the browser (minutes on 2 cores) run with COURSE_BROWSER_TESTS=full; "
    "nbval runs them in every `make test`, and tests/browser/test_browser_checks.py checks the explorer",
)


@FULL_ONLY
def test_lesson_03_runs_clean_and_its_explorer_responds(page, lab):
    problems = run_lesson(page, lab, "03_mixed_precision", timeout_s=300)
    assert not problems, "\n".join(problems)
    found = explorers(page)
    assert found.count() == 1, f"lesson 03 should show one precision explorer, found {found.count()}"
    check_explorer(found.first)


@FULL_ONLY
def test_lesson_01_trains_with_progress_bar_widgets(page, lab):
    problems = run_lesson(page, lab, "01_device_placement", timeout_s=420)
    assert not problems, "\n".join(problems)
    bars = page.locator(".jp-NotebookPanel .widget-hprogress .progress-bar")
    finished = page.locator(".jp-NotebookPanel .widget-hprogress .progress-bar-success")
    # pretrained_vs_scratch trains twice (pretrained, random init), each with a tqdm bar.
    assert finished.count() >= 2, f"{bars.count()} progress bar(s), {finished.count()} finished"
