"""nbgrader in JupyterLab: the learner's Validate button and menu, the instructor's formgrader."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from browser_lab import ROOT, expect, menu, menu_commands, open_notebook, skip_module_unless_available

skip_module_unless_available()
pytestmark = pytest.mark.slow  # JupyterLab in Chromium: tens of seconds per test

ASSIGNMENTS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
VALIDATE_TIMEOUT_MS = 180_000  # nbgrader runs the whole notebook in a fresh kernel


def validate(page):
    """Click Validate and return the results dialog once it shows."""
    button = page.locator(".jp-NotebookPanel-toolbar .validate-button")
    expect(button).to_be_visible()
    expect(button).to_contain_text("Validate")
    button.click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator(".jp-Dialog-header")).to_contain_text(
        "Validation Results", timeout=VALIDATE_TIMEOUT_MS
    )
    return dialog


def close_dialog(page):
    page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    expect(page.locator(".jp-Dialog")).to_have_count(0)


def test_exercise_validate_menu_and_no_news(page, lab):
    open_notebook(page, lab, "exercises/00_intro/00_intro.ipynb")
    commands = menu_commands(page, "Nbgrader")
    assert "nbgrader:open-formgrader" in commands, f"Nbgrader menu: {commands}"

    # A self-paced learner has no course exchange: the Assignment List is off in jupyter/ (README,
    # Set-up). Wherever it is on, it must not greet the learner with an error.
    if "nbgrader:open-assignment-list" in commands:
        menu(page, "Nbgrader", "nbgrader:open-assignment-list")
        course = page.locator("#nbgrader-assignment-list #course_list_default")
        expect(course).not_to_have_text(re.compile(r"^\s*(Loading.*)?$"), timeout=30_000)
        expect(page.locator("#nbgrader-assignment-list")).not_to_contain_text("Error fetching courses!")
        page.locator(".lm-TabBar-tab", has_text="00_intro.ipynb").click()

    # The release as handed out: the tests of the unanswered questions fail, and the dialog says so.
    dialog = validate(page)
    expect(dialog.locator(".validation-failed")).to_contain_text("The following cell failed")
    close_dialog(page)

    # JupyterLab's "Jupyter news" question stays away: off in jupyter/lab-settings/overrides.json.
    notification = lab.api("lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert notification["schema"]["properties"]["fetchNews"]["default"] == "false"
    expect(page.locator(".Toastify__toast", has_text=re.compile("news", re.I))).to_have_count(0)


def test_validate_passes_a_solved_exercise(page, lab):
    solved = lab.course / "solved" / "00_intro"
    subprocess.run(
        [sys.executable, "-m", "course_tools.release", "--answers", "00_intro", "--out", str(solved)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    open_notebook(page, lab, "solved/00_intro/00_intro.ipynb")
    dialog = validate(page)
    expect(dialog.locator(".validation-success")).to_contain_text(
        "Success! Your notebook passes all the tests."
    )
    close_dialog(page)


def test_formgrader_lists_every_assignment(page, lab):
    page.goto(f"{lab.url}/formgrader?token={lab.token}")
    names = page.locator("table.dataTable tbody tr td:first-child")
    expect(names).to_have_count(len(ASSIGNMENTS), timeout=60_000)
    assert sorted(names.all_inner_texts()) == ASSIGNMENTS
