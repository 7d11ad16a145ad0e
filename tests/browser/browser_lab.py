"""What a learner does in JupyterLab, and what they should see, for the browser tier.

Every wait here waits for a state of the page or the kernel (a prompt, the kernel status, a widget's
text), with a deadline; none sleeps for a guessed time. The checks return or raise messages that name
the cell and what is wrong, so a failure reads like a bug report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

try:
    from playwright.sync_api import Locator, Page, expect
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
except ImportError:  # no browser extra: the tests using these are skipped (conftest.browser_tier)
    Locator = Page = expect = PlaywrightTimeoutError = None

ROOT = Path(__file__).resolve().parents[2]
WIDGET_NOTE = "(interactive widget or progress bar: run the notebook to see it live)"  # course_tools.nbtools
KERNEL_START_MS = 120_000
ENABLE_HINT = (
    "enable it with `sudo apt-get install chromium fonts-noto-cjk` and "
    "`.venv/bin/python -m pip install -e '.[dev,browser,site]'` (CONTRIBUTING, 'The browser tier')"
)


def tier_mode() -> str:
    """COURSE_BROWSER_TESTS: what the tier does.

    auto (default)  run where Chromium and Playwright are installed, else skip with one line
    require         fail where they are missing
    full            require, and Run All in lessons 01 and 03 too (minutes on 2 cores)
    off             skip the tier
    """
    mode = os.environ.get("COURSE_BROWSER_TESTS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "require", "full", "off"):
        raise pytest.UsageError(
            f"COURSE_BROWSER_TESTS={mode!r}: use auto (the default), require, full or off."
        )
    return mode


def required() -> bool:
    return tier_mode() in ("require", "full")


def find_chromium() -> str | None:
    """The system Chromium (COURSE_CHROMIUM overrides); Playwright's own download is not used."""
    explicit = os.environ.get("COURSE_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def missing_requirements() -> str | None:
    """What the tier lacks here, as one line that says how to enable it; None when nothing is missing."""
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("Playwright (the project's `browser` extra)")
    if find_chromium() is None:
        missing.append("Chromium")
    return f"browser tier: {' and '.join(missing)} not installed; {ENABLE_HINT}" if missing else None


def skip_module_unless_available() -> None:
    """Called by each browser test module: skip it, with the same line for all, when the tier cannot run.

    Under COURSE_BROWSER_TESTS=require or full nothing is skipped here: the ``browser_tier`` fixture fails.
    """
    mode = tier_mode()
    reason = "browser tier off (COURSE_BROWSER_TESTS=off)" if mode == "off" else missing_requirements()
    if reason and not required():
        pytest.skip(reason, allow_module_level=True)  # one place: pytest folds the modules' skips


# The state of the notebook in the page: each code cell's prompt, the kernel status in the status bar.
_RUN_STATE_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
    .map(p => p.textContent.trim());
  const status = [...document.querySelectorAll('.jp-StatusBar-TextItem')]
    .map(s => s.textContent).find(t => / \\| /.test(t)) || '';
  if (/\\| *Dead/.test(status)) return {done: true, status, prompts};
  const running = prompts.some(p => p === '[*]:');
  const started = prompts.some(p => /^\\[\\d+\\]:$/.test(p));
  return (!running && started && /\\| *Idle/.test(status)) ? {done: true, status, prompts} : null;
}"""

# What the page shows for each code cell, in order.
_CELLS_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')].map(cell => {
  const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
  return {
    prompt: (cell.querySelector('.jp-InputPrompt') || {}).textContent?.trim() || '',
    // a lesson's 確認 cell has its source collapsed: no input prompt shows its count (the saved file has it)
    collapsed: !!cell.querySelector('.jp-InputPlaceholder') || cell.classList.contains('jp-mod-inputCollapsed')
               || !cell.querySelector('.jp-InputPrompt'),
    stderr: outputs.filter(o => o.dataset.mimeType === 'application/vnd.jupyter.stderr')
                   .map(o => o.innerText),
    text: outputs.map(o => o.innerText).join('\\n'),
    widgetViews: outputs.filter(o => o.querySelector(':scope > .jupyter-widgets')).length,
    progressBars: [...cell.querySelectorAll('.widget-hprogress .progress-bar')].map(b => b.className),
    images: [...cell.querySelectorAll('img')].map(i => ({
      src: i.getAttribute('src')?.slice(0, 60) || '', complete: i.complete, width: i.naturalWidth})),
  };
})"""

_BROKEN_MARKDOWN_IMAGES_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-MarkdownCell img')]
  .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src')?.slice(0, 60) || '')"""

_IMAGES_SETTLED_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel img')].every(i => i.complete)
  && ![...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')]
       .some(o => o.innerText.includes('Loading widget'))"""


def open_notebook(page: Page, lab, path: str) -> Locator:
    """Open ``path`` (relative to the course) in its own workspace; return the panel once the kernel is idle."""
    page.goto(lab.page_url(path, page.course_workspace))
    panel = page.locator(".jp-NotebookPanel").first
    expect(panel).to_be_visible(timeout=60_000)
    kernel_idle = page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| *Idle"))
    expect(kernel_idle).to_be_visible(timeout=KERNEL_START_MS)
    return panel


def menu(page: Page, label: str, command: str) -> None:
    """Click the main menu ``label``, then its item that runs ``command``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(label)}$")).click()
    page.locator(f".lm-Menu-item[data-command='{command}']").click()


def menu_commands(page: Page, label: str) -> dict[str, str]:
    """The visible items of the main menu ``label``: {command: label}; the menu is closed again."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(label)}$")).click()
    items = page.locator(".lm-Menu .lm-Menu-item[data-command]:not(.lm-mod-hidden)")
    items.first.wait_for()
    found = {
        item.get_attribute("data-command"): item.locator(".lm-Menu-itemLabel").inner_text()
        for item in items.all()
    }
    page.keyboard.press("Escape")
    return found


def run_all(page: Page, timeout_s: float) -> dict:
    """Clear all outputs, Run -> Run All Cells, and wait until no cell is queued and the kernel is idle."""
    menu(page, "Edit", "editmenu:clear-all")
    expect(page.locator(".jp-NotebookPanel .jp-InputPrompt", has_text=re.compile(r"\d"))).to_have_count(0)
    menu(page, "Run", "runmenu:run-all")
    start = time.monotonic()
    try:
        state = page.wait_for_function(_RUN_STATE_JS, timeout=timeout_s * 1000, polling=250).json_value()
    except PlaywrightTimeoutError:
        shown = cells_shown(page)
        running = [i for i, cell in enumerate(shown, start=1) if cell["prompt"] == "[*]:"]
        done = sum(bool(re.fullmatch(r"\[\d+\]:", cell["prompt"])) for cell in shown)
        raise AssertionError(
            f"Run All did not finish in {timeout_s:g} s: {done} of {len(shown)} code cells ran, "
            f"cell(s) {spans(running)} still queued or running (load average {os.getloadavg()[0]:.1f})"
        ) from None
    if "Dead" in state["status"]:
        raise AssertionError(
            f"the kernel died during Run All ({state['status']}); prompts {state['prompts']}"
        )
    state["seconds"] = round(time.monotonic() - start, 1)
    page.wait_for_function(_IMAGES_SETTLED_JS, timeout=15_000, polling=250)
    return state


def save(page: Page, file: Path, timeout_s: float = 30) -> None:
    """File -> Save Notebook, and wait until ``file`` (the notebook on disk) has been written."""
    dirty = page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty")
    unsaved, before = dirty.count() > 0, file.stat().st_mtime_ns
    menu(page, "File", "docmanager:save")
    expect(dirty).to_have_count(0, timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    while unsaved and file.stat().st_mtime_ns == before:  # (an autosave may have written it already)
        if time.monotonic() > deadline:
            raise AssertionError(f"File -> Save did not write {file} within {timeout_s:g} s")
        time.sleep(0.1)  # polling the file's state, not waiting for a guessed duration


def cells_shown(page: Page) -> list[dict]:
    return page.evaluate(_CELLS_JS)


def committed_widget_notes(path: Path) -> list[int]:
    """For each code cell of the committed notebook: how many widget views it showed when run."""
    nb = json.loads(path.read_text())
    return [
        sum(
            "".join(out.get("data", {}).get("text/plain", "")) == WIDGET_NOTE
            for out in cell.get("outputs", [])
        )
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
    ]


def committed_images(path: Path) -> int:
    nb = json.loads(path.read_text())
    return sum(
        "image/png" in out.get("data", {}) or "image/svg+xml" in out.get("data", {})
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
    )


def notebook_problems(page: Page, saved: Path, committed: Path | None = None) -> list[str]:
    """What is wrong after Run All, as the learner sees it (page) and as it was saved (``saved``).

    ``committed``: the notebook as committed, whose widget notes and images the run must show too.
    """
    problems = []
    shown = cells_shown(page)
    numbers, not_run = [], []
    for i, cell in enumerate(shown, start=1):
        where = f"code cell {i}"
        match = re.fullmatch(r"\[(\d+)\]:", cell["prompt"])
        if match is not None:
            numbers.append(int(match.group(1)))
        elif not (cell.get("collapsed") and not cell["prompt"]):
            not_run.append(i)
        for text in cell["stderr"]:
            if "Traceback" in text:
                problems.append(f"{where} shows a traceback: {text.strip()[-400:]}")
            if re.search(r"\d+%\|", text):
                problems.append(
                    f"{where} prints a text progress bar instead of a widget: {text.strip()[:200]}"
                )
        if "IProgress not found" in cell["text"] or "Error displaying widget" in cell["text"]:
            problems.append(f"{where}: a widget did not render: {cell['text'][:300]}")
        for bar in cell["progressBars"]:
            if "danger" in bar:  # tqdm turns a bar red when its loop ends early (an exception)
                problems.append(f"{where}: a progress bar stopped early (red)")
        for image in cell["images"]:
            if not image["complete"] or image["width"] == 0:
                problems.append(f"{where}: an image did not load ({image['src']}...)")
    for src in page.evaluate(_BROKEN_MARKDOWN_IMAGES_JS):
        problems.append(f"a markdown image did not load ({src}...)")
    if not_run:
        problems.append(f"code cell(s) {spans(not_run)} of {len(shown)} did not run (no execution count)")
    if numbers != sorted(set(numbers)):
        problems.append(f"execution counts out of order: {numbers}")

    nb = json.loads(saved.read_text())
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    if len(code) != len(shown):
        problems.append(f"the page shows {len(shown)} code cells, the saved notebook has {len(code)}")
    unsaved = [i for i, cell in enumerate(code, start=1) if cell.get("execution_count") is None]
    if unsaved != not_run:
        problems.append(f"the saved notebook has no execution count in code cell(s) {spans(unsaved)}")
    for i, cell in enumerate(code, start=1):
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                problems.append(f"code cell {i} raised {out['ename']}: {out['evalue'][:300]}")

    if committed is not None:
        for i, (want, cell) in enumerate(
            zip(committed_widget_notes(committed), shown, strict=False), start=1
        ):
            if cell["widgetViews"] < want:
                problems.append(
                    f"code cell {i} shows {cell['widgetViews']} widget view(s), the lesson has {want} "
                    "(an explorer or a progress bar is missing)"
                )
        images = sum(len(cell["images"]) for cell in shown)
        if images < committed_images(committed):
            problems.append(
                f"{images} image(s) shown, the committed lesson has {committed_images(committed)}"
            )
    return sorted(problems, key=lambda problem: " raised " not in problem)  # the errors first


def spans(numbers: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def explorers(page: Page) -> Locator:
    """Every precision explorer (course_lib.widgets) shown in the notebook's outputs."""
    return (
        page.locator(".jp-OutputArea-output")
        .filter(has=page.locator(".widget-text input"))
        .filter(has=page.locator(".widget-dropdown select"))
    )


def check_explorer(explorer: Locator, timeout_ms: float = 10_000) -> None:
    """Type a number (no Enter) and pick a scale; the explorer's text must follow each change.

    Raises AssertionError saying which step the explorer did not follow.
    """
    number = explorer.locator(".widget-text input")
    scale = explorer.locator(".widget-dropdown select")
    shown = explorer.locator(".widget-html-content")

    def follows(step: str, *texts: str) -> None:
        try:
            for text in texts:
                expect(shown).to_contain_text(text, timeout=timeout_ms)
        except AssertionError:
            raise AssertionError(
                f"precision explorer: {step}, but its output did not follow within {timeout_ms / 1000:g} s; "
                f"it shows:\n{shown.inner_text()}"
            ) from None

    follows("it was displayed", "format", "fp16")
    number.click()
    number.press("Control+A")
    number.press_sequentially("70000", delay=40)  # as a learner types, without pressing Enter
    follows("70000 was typed (no Enter)", "x = 70000", "OVERFLOW")
    scale.select_option(label="2^16 (GradScaler start)")
    follows("the scale 2^16 was picked", "x = 70000 x scale 65536")
    number.press("Control+A")
    number.press_sequentially("1e-8", delay=40)
    follows("1e-8 was typed with the scale 2^16", "x = 1e-08 x scale 65536")
    if "UNDERFLOW" in shown.inner_text():
        raise AssertionError(
            f"precision explorer: 1e-8 x 2^16 should not underflow in fp16:\n{shown.inner_text()}"
        )
