"""The browser tier: the course in JupyterLab, driven in Chromium by Playwright.

One JupyterLab (from this environment, on a free 127.0.0.1 port, with a token) serves a temporary copy
of the course for the whole session, with temporary Jupyter config, data and runtime folders and the
course's own settings (``jupyter/``, as ``make lab`` uses them). It inherits the suite's offline,
network-guarded environment (the root ``conftest.py``), so the server, every kernel it starts and
nbgrader refuse connections that leave the machine. One Chromium serves every test; each test gets a
fresh browser context and its own JupyterLab workspace, and its kernels are shut down after it.

Without Chromium or Playwright the tier is skipped with one line that says how to enable it;
``COURSE_BROWSER_TESTS=require`` (CI) turns that skip into a failure, ``=off`` skips the tier.
On failure, a screenshot, the browser console and the Jupyter log go to ``test-artifacts/browser/``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from browser_lab import find_chromium, missing_requirements, required, tier_mode

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
# What a copy of the course needs: the lessons, the exercises, nbgrader's source and its config.
COURSE_ITEMS = ("notebooks", "exercises", "solutions", "nbgrader_config.py")
LAB_START_TIMEOUT = 90  # seconds; JupyterLab starts in about 5 s on 2 idle cores
CHROMIUM_ARGS = [
    "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--metrics-recording-only",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "browser_tier" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser_tier() -> str:
    """The Chromium to drive; fails under COURSE_BROWSER_TESTS=require (or full) when something is missing.

    (Otherwise the modules are skipped before this runs: browser_lab.skip_module_unless_available.)
    """
    mode = tier_mode()
    reason = "browser tier off (COURSE_BROWSER_TESTS=off)" if mode == "off" else missing_requirements()
    if reason:
        if required():
            pytest.fail(f"{reason} (COURSE_BROWSER_TESTS={mode})", pytrace=False)
        pytest.skip(reason)
    return find_chromium()


# --- JupyterLab -------------------------------------------------------------------------------------


@dataclass
class Lab:
    """A running JupyterLab: its URL, token, course copy and log."""

    url: str
    token: str
    course: Path
    log: Path
    process: subprocess.Popen = field(repr=False)

    def page_url(self, path: str, workspace: str) -> str:
        """The URL that opens ``path`` (relative to the course) in a workspace of its own."""
        return f"{self.url}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def api(self, path: str, method: str = "GET", data: dict | None = None):
        body = None if data is None else json.dumps(data).encode()
        request = urllib.request.Request(
            f"{self.url}/{path.lstrip('/')}",
            data=body,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def shutdown_kernels(self) -> None:
        """End every session and kernel (each test starts its own)."""
        for session in self.api("api/sessions"):
            self.api(f"api/sessions/{session['id']}", method="DELETE")
        for kernel in self.api("api/kernels"):
            self.api(f"api/kernels/{kernel['id']}", method="DELETE")

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines, without the warning every kernel start repeats."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        noise = ("Kernel is running over TCP without encryption", "websocket_ping_timeout")
        return "\n".join([line for line in text.splitlines() if not any(n in line for n in noise)][-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_environment(tmp: Path) -> dict[str, str]:
    """The suite's environment (offline, network guard) with Jupyter's folders in ``tmp``."""
    env = dict(os.environ)
    netguard = str(ROOT / "tests" / "netguard")
    assert env.get("HF_HUB_OFFLINE") == "1" and netguard in env.get("PYTHONPATH", "").split(os.pathsep), (
        "the browser tier expects the suite's offline environment (conftest.py at the repository root)"
    )
    for name in ("config", "data", "runtime", "ipython"):
        (tmp / name).mkdir()
    env.update(
        {
            # Nothing from the user's ~/.jupyter or ~/.local/share/jupyter (kernels, settings,
            # workspaces); lab extensions (nbgrader, widgets) come from the environment's share/jupyter.
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
            "JUPYTER_DATA_DIR": str(tmp / "data"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "IPYTHONDIR": str(tmp / "ipython"),
            # The course's settings, exactly as `make lab` passes them.
            "JUPYTER_CONFIG_PATH": str(ROOT / "jupyter"),
            # nbgrader's formgrader shells out to the `alembic` found on PATH: this environment's.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        }
    )
    env.pop("JUPYTER_PATH", None)
    # Idle OpenMP threads of the kernel's torch sleep instead of spinning while Chromium draws on the
    # same 2 cores (CONTRIBUTING, "Threads and load"); the root conftest.py may have set it already.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def copy_course(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "gradebook.db")
    dest.mkdir()
    for name in COURSE_ITEMS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def stop(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM (JupyterLab shuts its kernels down), then SIGKILL to the whole process group."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # kernels left behind by a server that hung
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(timeout=timeout)


@pytest.fixture(scope="session")
def lab(browser_tier, tmp_path_factory) -> Lab:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # what an earlier run left
    tmp = tmp_path_factory.mktemp("jupyterlab")
    course = copy_course(tmp / "course")
    env = lab_environment(tmp)
    token = secrets.token_hex(24)
    jupyter_lab = Path(sys.executable).with_name("jupyter-lab")
    command = [str(jupyter_lab)] if jupyter_lab.exists() else [sys.executable, "-m", "jupyterlab"]
    command += [
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={free_port()}",
        "--port-retries=20",
        f"--ServerApp.root_dir={course}",
        f"--IdentityProvider.token={token}",
        "--ServerApp.terminals_enabled=False",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = tmp / "jupyter.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=course,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: the server and its kernels
        )
    try:
        url = wait_for_server(process, tmp / "runtime", token, log)
        yield Lab(url=url, token=token, course=course, log=log, process=process)
    finally:
        stop(process)
        if ARTIFACTS.exists():  # a test failed: keep the whole log beside its screenshot
            shutil.copy2(log, ARTIFACTS / "jupyter.log")


def wait_for_server(process: subprocess.Popen, runtime: Path, token: str, log: Path) -> str:
    """The server's URL once ``/api/status`` answers (read from its runtime file: the port it got)."""
    deadline = time.monotonic() + LAB_START_TIMEOUT
    info = runtime / f"jpserver-{process.pid}.json"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if info.exists():
            try:
                url = json.loads(info.read_text())["url"].rstrip("/")
                request = urllib.request.Request(
                    f"{url}/api/status", headers={"Authorization": f"token {token}"}
                )
                with urllib.request.urlopen(request, timeout=5):
                    return url
            except (OSError, ValueError, KeyError, urllib.error.URLError):
                pass
        time.sleep(0.2)  # polling the server's state, not waiting for a guessed duration
    raise RuntimeError(f"JupyterLab did not answer within {LAB_START_TIMEOUT} s:\n{log.read_text()[-3000:]}")


# --- Chromium ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser(browser_tier):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=browser_tier, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed and "page" in getattr(item, "funcargs", {}):
        saved = save_artifacts(item.funcargs["page"], item)
        report.sections.append(("browser artifacts", saved))
    return report


SCROLL_TO_FIRST_ERROR_JS = """() => [...document.querySelectorAll(
  '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .find(o => /Traceback|Error/.test(o.innerText))?.scrollIntoView({block: 'center'})"""


def save_artifacts(page, item) -> str:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", item.name)
    lines = []
    try:
        page.evaluate(SCROLL_TO_FIRST_ERROR_JS)
        page.screenshot(path=str(ARTIFACTS / f"{stem}.png"), full_page=True)
        lines.append(f"screenshot: {ARTIFACTS / f'{stem}.png'}")
    except Exception as err:  # the page may be gone
        lines.append(f"screenshot failed: {err}")
    console = getattr(page, "course_console", [])
    (ARTIFACTS / f"{stem}.console.txt").write_text("\n".join(console) + "\n")
    lines.append(f"browser console: {ARTIFACTS / f'{stem}.console.txt'}")
    lab = item.funcargs.get("lab")
    if lab is not None:
        shutil.copy2(lab.log, ARTIFACTS / "jupyter.log")
        lines.append(f"Jupyter log: {ARTIFACTS / 'jupyter.log'} (last lines below)\n{lab.log_tail()}")
    return "\n".join(lines)


@pytest.fixture
def page(browser, lab, request):
    """A fresh browser context and page; its kernels are shut down afterwards."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, locale="ja-JP")
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.course_console = []
    page.on("console", lambda m: page.course_console.append(f"[{m.type}] {m.text}"))
    page.on("pageerror", lambda e: page.course_console.append(f"[pageerror] {e}"))
    page.course_workspace = re.sub(r"[^A-Za-z0-9-]+", "-", request.node.name)[:60]
    try:
        yield page
    finally:
        context.close()
        lab.shutdown_kernels()
