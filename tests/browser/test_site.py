"""The course's static site (``make site``): built offline, and opened page by page in Chromium.

The site is built once into a temporary folder with the same code as ``make site`` and served on
127.0.0.1. Every page must load without a console error and without a request that leaves the server
(fonts, scripts, images: all local), show each plot its lesson committed, and link only to pages,
anchors and files the site has. Japanese must be drawn in Noto CJK, the search must find a lesson by a
Japanese word, and nothing of ``solutions/`` may reach the site: neither nbgrader's markers nor a line
of a solution or a hidden test that the lessons and the release do not show themselves.

Without the ``site`` extra (MkDocs) the module is skipped with one line, like the rest of the tier
without Chromium; ``COURSE_BROWSER_TESTS=require`` (CI) turns both into failures.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import json
import re
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from browser_lab import ROOT, committed_images, required, skip_module_unless_available, tier_mode

from course_tools import site

skip_module_unless_available()
pytestmark = pytest.mark.slow  # a MkDocs build and every page in Chromium: about a minute on 2 cores

SITE_EXTRA = ("mkdocs", "material", "latex2mathml")
SITE_HINT = "install it with `.venv/bin/python -m pip install -e '.[dev,browser,site]'` (README, Tests)"
LEAK_MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff00-\uffef]")

_missing = [name for name in SITE_EXTRA if importlib.util.find_spec(name) is None]
if _missing and not required() and tier_mode() != "off":
    pytest.skip(
        f"site tests: the `site` extra ({', '.join(_missing)}) is not installed; {SITE_HINT}",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def site_extra() -> None:
    """Fails under COURSE_BROWSER_TESTS=require when MkDocs is missing (otherwise the module was skipped)."""
    if _missing:
        pytest.fail(f"the `site` extra ({', '.join(_missing)}) is not installed; {SITE_HINT}", pytrace=False)


@pytest.fixture(scope="module")
def built(site_extra, tmp_path_factory) -> Path:
    """The site, built by ``make site``'s code into a temporary folder: its html/ folder."""
    return site.build(ROOT, tmp_path_factory.mktemp("site"))


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test reports what failed; no line per request
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a page left before a file was sent: no traceback
        pass


@pytest.fixture(scope="module")
def server(built):
    httpd = _Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def site_page(browser, server):
    """A page that records console errors, failed or 4xx/5xx responses, and blocks any other host."""
    context = browser.new_context(viewport={"width": 1300, "height": 900}, locale="ja-JP")
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.problems = []
    page.on("console", lambda m: m.type == "error" and page.problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: page.problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and page.problems.append(f"HTTP {r.status}: {r.url}"))

    def route(request_route):
        if request_route.request.url.startswith(server):
            request_route.continue_()
        else:
            page.problems.append(f"a request leaves the site: {request_route.request.url}")
            request_route.abort()

    context.route("**/*", route)
    try:
        yield page
    finally:
        context.close()


def pages_of(built: Path) -> list[str]:
    """Every page of the site as its URL path ('' for the home page)."""
    return sorted(
        "" if p.parent == built else p.parent.relative_to(built).as_posix() + "/"
        for p in built.rglob("index.html")
    )


@functools.cache
def anchors_of(file: Path) -> frozenset[str]:
    return frozenset(re.findall(r'\sid="([^"]+)"', file.read_text(encoding="utf-8", errors="replace")))


def link_problem(built: Path, server: str, href: str) -> str | None:
    """Why ``href`` (an absolute URL found on a page) is broken; None when its file and anchor exist."""
    if not href.startswith(server):
        return None  # another host: not loaded by the page, and not reachable offline to check
    parts = urlsplit(href)
    path = built / unquote(parts.path).lstrip("/")
    target = path / "index.html" if path.is_dir() else path
    if not target.is_file():
        return f"no such page or file: {parts.path}"
    if parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in anchors_of(target):
        return f"no anchor #{parts.fragment} in {parts.path}"
    return None


_PAGE_STATE_JS = """() => ({
  images: [...document.querySelectorAll('article img')].map(i => ({
      src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0})),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
})"""


def test_every_page_loads_clean_with_its_plots_and_no_broken_link(site_page, built, server):
    pages, problems = pages_of(built), []
    lessons = {p.stem: p for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert len(pages) >= len(lessons) + 2, f"the site has only {len(pages)} pages: {pages}"
    for path in pages:
        site_page.problems.clear()
        # networkidle: the search's worker and its Japanese segmenter have loaded before the next page.
        site_page.goto(server + path, wait_until="networkidle")
        site_page.wait_for_function("() => [...document.images].every(i => i.complete)")
        state = site_page.evaluate(_PAGE_STATE_JS)
        found = list(site_page.problems)
        found += [f"an image did not load: {image['src']}" for image in state["images"] if not image["ok"]]
        found += [
            f"broken link {href}: {why}"
            for href in sorted(set(state["links"]))
            if (why := link_problem(built, server, href))
        ]
        match = re.fullmatch(r"lessons/([^/]+)/", path)
        if match and match.group(1) in lessons:
            want = committed_images(lessons[match.group(1)])
            shown = sum(image["ok"] for image in state["images"])
            if shown < want:
                found.append(f"{shown} plot(s) shown, the committed lesson has {want}")
        problems += [f"/{path}: {problem}" for problem in found]
    assert not problems, "\n".join(problems)


def test_each_lesson_page_links_its_exercise_and_its_notebook(built):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = (built / "lessons" / notebook.stem / "index.html").read_text(encoding="utf-8")
        assert f'href="../{notebook.name}"' in page, f"lesson {notebook.stem} does not link its notebook"
        assert (built / "lessons" / notebook.name).read_bytes() == notebook.read_bytes()
        for exercise in sorted((ROOT / "exercises" / notebook.stem).glob("*.ipynb")):
            link = f'href="../../exercises/{notebook.stem}/{exercise.stem}/"'
            assert link in page, f"lesson {notebook.stem} does not link its exercise {exercise.name}"
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert (built / "docs" / doc.stem / "index.html").is_file(), (
            f"docs page {doc.name} is not on the site"
        )


def _platform_fonts(page, selector: str) -> list[dict]:
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    return cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]


@pytest.mark.parametrize("path", ["", "lessons/03_mixed_precision/"])
def test_japanese_is_drawn_in_noto_cjk(site_page, server, path):
    site_page.goto(server + path, wait_until="load")
    heading = site_page.locator("article h1").first.inner_text()
    japanese = len(JAPANESE.findall(heading))
    assert japanese, f"the page's title has no Japanese to check: {heading!r}"
    fonts = _platform_fonts(site_page, "article h1")
    cjk = sum(f["glyphCount"] for f in fonts if "CJK" in f["familyName"] and "Noto" in f["familyName"])
    assert cjk >= japanese, f"{heading!r}: {japanese} Japanese characters, drawn with {fonts}"


def test_search_finds_a_lesson_by_a_japanese_word(site_page, server):
    site_page.goto(server, wait_until="load")
    site_page.locator("input.md-search__input").click()
    site_page.locator("input.md-search__input").press_sequentially("混合精度", delay=50)
    results = site_page.locator(".md-search-result__item a[href*='lessons/03_mixed_precision']")
    results.first.wait_for(timeout=30_000)
    assert not site_page.problems, "\n".join(site_page.problems)


# --- Nothing of solutions/ on the site --------------------------------------------------------------


def _sources(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    texts = []
    for cell in nb["cells"]:
        texts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            texts += ["".join(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return texts


def secret_lines(root: Path = ROOT) -> set[str]:
    """Lines of the solutions and hidden tests that no lesson, release notebook or docs page shows."""
    secret = set()
    for path in sorted((root / "solutions").rglob("*.ipynb")):
        for text in _sources(path):
            for block in re.findall(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", text, re.S):
                secret |= {line.strip() for line in block.splitlines() if len(line.strip()) >= 16}
    shown = [text for p in (root / "notebooks").glob("*.ipynb") for text in _sources(p)]
    shown += [text for p in (root / "exercises").rglob("*.ipynb") for text in _sources(p)]
    shown += [p.read_text(encoding="utf-8") for p in (root / "docs").glob("*.md")]
    published = "\n".join(shown)
    return {line for line in secret if line not in published}


def site_text(built: Path) -> str:
    """All text of the built site as a reader or a search engine gets it: tags dropped, entities read."""
    texts = []
    for path in sorted(built.rglob("*")):
        if path.suffix in (".html", ".json", ".ipynb", ".md", ".txt", ".xml"):
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            if path.suffix == ".html":
                texts.append(html.unescape(re.sub(r"<[^>]+>", "", text)))
            if path.suffix in (".json", ".ipynb"):
                texts.append(json.dumps(json.loads(text), ensure_ascii=False))
    return "\n".join(texts)


def leaks(built: Path, secret: set[str]) -> list[str]:
    text = site_text(built)
    return [f"marker {m!r}" for m in LEAK_MARKERS if m in text] + sorted(
        f"line {s!r}" for s in secret if s in text
    )


def test_no_solution_or_hidden_test_reaches_the_site(built):
    secret = secret_lines()
    assert len(secret) > 20, f"only {len(secret)} solution lines to look for: the search would prove little"
    found = leaks(built, secret)
    assert not found, "the site publishes solutions/ content:\n" + "\n".join(found[:40])


def test_the_leak_search_finds_a_solution_line_and_a_marker(built, tmp_path):
    copy = tmp_path / "html"
    shutil.copytree(built, copy)
    line = sorted(secret_lines())[0]
    page = copy / "lessons" / "00_intro" / "index.html"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("</article>", f"<pre><code>{html.escape(line)}</code></pre></article>"))
    assert leaks(copy, {line}) == [f"line {line!r}"]
    (copy / "search" / "extra.json").write_text(json.dumps({"text": "### BEGIN HIDDEN TESTS"}))
    assert leaks(copy, set()) == ["marker 'BEGIN HIDDEN TESTS'"]


def test_a_new_docs_page_is_published_without_config_and_its_unknown_links_become_text(site_extra, tmp_path):
    root = tmp_path / "course"
    for name in ("notebooks/00_intro.ipynb", "exercises/00_intro/00_intro.ipynb", "mkdocs.yml"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    (root / "docs").mkdir()
    (root / "docs" / "zz_new_page.md").write_text(
        "# A page the site does not know yet\n\nSee [the lesson](../notebooks/00_intro.ipynb), "
        "[the README](../README.md#set-up) and [a module](../course_lib/data.py).\n"
        "- a list right after text\n  - nested by two spaces\n"
    )
    html_dir = site.build(root, tmp_path / "build")
    page = (html_dir / "docs" / "zz_new_page" / "index.html").read_text(encoding="utf-8")
    assert 'href="../../lessons/00_intro/"' in page and 'href="../.."' in page
    assert "a module" in page and "data.py" not in page  # the link to an unpublished file is text
    assert re.search(r"<li>a list right after text\s*<ul>\s*<li>nested by two spaces</li>", page), page
    assert "A page the site does not know yet" in (html_dir / "index.html").read_text(encoding="utf-8")
