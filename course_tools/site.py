"""The course as a static site: ``make site`` (``python -m course_tools.site``) -> build/site/html/.

MkDocs with the Material theme builds it (the ``site`` extra in pyproject.toml; mkdocs.yml holds the
theme, the search and the Markdown extensions). This module stages MkDocs' source folder first,
build/site/src/, from what is in the working tree, and executes nothing:

- ``lessons/<name>.md`` for each ``notebooks/<name>.ipynb``, with its committed outputs and plots, a box
  that links the lesson's exercise and its notebook (copied beside the page to download);
- ``exercises/<assignment>/<name>.md`` for each notebook of the student release ``exercises/`` (never
  ``solutions/``): the build stops if a solution or hidden-test marker is anywhere in the staged tree;
- ``docs/<name>.md`` for every ``docs/*.md``, whatever its name (and ``docs/img/``);
- ``index.md``, the Japanese home page, and build/site/mkdocs.yml: it inherits mkdocs.yml and adds the
  navigation (ホーム, レッスン, 演習, 資料), so a new lesson or docs page needs no change to any config.

Links between these files are rewritten to the site's pages (``site_markdown.LinkMap``); formulas
become MathML (``site_math``). Nothing is downloaded (the theme's web fonts are off in mkdocs.yml).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from course_tools.site_markdown import LinkMap, jupyter_to_mkdocs
from course_tools.site_pages import (
    exercise_box,
    index_markdown,
    lesson_box,
    notebook_markdown,
    title_of,
)

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "site"
COURSE_TITLE = "PyTorch による効率的な AI モデルトレーニング"
# What must never reach the site (nbgrader's markers in solutions/; the release removes them).
LEAK_MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
CSS = """\
.md-typeset .nb-output, .md-typeset .nb-stderr { margin-top: -0.6em; }
.md-typeset .nb-output pre > code { border-left: 0.2rem solid var(--md-default-fg-color--lighter); }
.md-typeset .nb-stderr pre > code { border-left: 0.2rem solid #e57373; background: #fff5f5; }
.md-typeset img { max-width: 100%; }
"""


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def course_files(root: Path) -> dict:
    """The lessons, the release's exercise notebooks by assignment, and the docs pages, as in the tree."""
    exercises = {
        folder.name: sorted(folder.glob("*.ipynb"))
        for folder in sorted((root / "exercises").iterdir())
        if folder.is_dir() and any(folder.glob("*.ipynb"))
    }
    return {
        "lessons": sorted((root / "notebooks").glob("*.ipynb")),
        "exercises": exercises,
        "docs": sorted((root / "docs").glob("*.md")),
    }


def stage(root: Path = ROOT, dest: Path = BUILD) -> dict:
    """Write MkDocs' source folder (``dest``/src) and config (``dest``/mkdocs.yml); return what went in."""
    src = dest / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    files = course_files(root)
    rel = lambda path: path.relative_to(root).as_posix()  # noqa: E731

    pages = {rel(nb): f"lessons/{nb.stem}.md" for nb in files["lessons"]}
    for assignment, notebooks in files["exercises"].items():
        pages |= {rel(nb): f"exercises/{assignment}/{nb.stem}.md" for nb in notebooks}
    pages |= {rel(doc): f"docs/{doc.name}" for doc in files["docs"]}
    assets = (
        [p for p in (root / "docs" / "img").rglob("*") if p.is_file()] if (root / "docs/img").is_dir() else []
    )
    pages |= {rel(asset): rel(asset) for asset in assets}
    links = LinkMap(pages=pages, home={"README.md"})

    exercise_titles = {
        rel(nb_path): title_of(load(nb_path)["cells"])
        for notebooks in files["exercises"].values()
        for nb_path in notebooks
    }

    lessons, nav_lessons = [], []
    for nb_path in files["lessons"]:
        nb, page = load(nb_path), pages[rel(nb_path)]
        own = [rel(p) for p in files["exercises"].get(nb_path.stem, [])]
        exercises = [(exercise_titles[p], f"../{pages[p]}") for p in own]
        body = notebook_markdown(
            nb,
            rel(nb_path),
            page,
            src / "lessons",
            links,
            lesson_box(nb_path.name, exercises, nb.get("metadata", {}).get("summary", "")),
        )
        write(src / page, body)
        shutil.copy2(nb_path, src / "lessons" / nb_path.name)
        title = title_of(nb["cells"])
        lessons.append(
            {
                "title": title,
                "page": page,
                "notebook": f"lessons/{nb_path.name}",
                "exercises": [(exercise_titles[p], pages[p]) for p in own],
            }
        )
        nav_lessons.append({title: page})

    nav_exercises = []
    for assignment, notebooks in files["exercises"].items():
        lesson_nb = f"notebooks/{assignment}.ipynb"
        for nb_path in notebooks:
            nb, page = load(nb_path), pages[rel(nb_path)]
            lesson = None
            if lesson_nb in pages:
                lesson = (title_of(load(root / lesson_nb)["cells"]), f"../../{pages[lesson_nb]}")
            box = exercise_box(nb_path.name, lesson, rel(nb_path))
            write(src / page, notebook_markdown(nb, rel(nb_path), page, (src / page).parent, links, box))
            shutil.copy2(nb_path, (src / page).parent / nb_path.name)
            nav_exercises.append({exercise_titles[rel(nb_path)]: page})

    nav_docs = []
    for doc in files["docs"]:
        text = doc.read_text(encoding="utf-8")
        page = pages[rel(doc)]
        write(src / page, jupyter_to_mkdocs(links.rewrite(text, rel(doc), page)))
        heading = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), doc.stem)
        nav_docs.append({heading: page})
    for asset in assets:
        (src / rel(asset)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(asset, src / rel(asset))

    write(
        src / "index.md",
        index_markdown(COURSE_TITLE, lessons, [(t, p) for d in nav_docs for t, p in d.items()]),
    )
    write(src / "stylesheets" / "course.css", CSS)
    leaks = leaked_markers(src)
    if leaks:
        raise SystemExit(
            "the site would publish solutions or hidden tests; markers found in:\n" + "\n".join(leaks)
        )
    nav = [
        {"ホーム": "index.md"},
        {"レッスン": nav_lessons},
        {"演習": nav_exercises},
        {"資料（英語）": nav_docs},
    ]
    config = {
        "INHERIT": str(root / "mkdocs.yml"),
        "docs_dir": "src",
        "site_dir": "html",
        "nav": [entry for entry in nav if list(entry.values())[0]],
    }
    # JSON is YAML: the generated config needs no YAML writer.
    write(dest / "mkdocs.yml", json.dumps(config, ensure_ascii=False, indent=1))
    return {
        "lessons": len(lessons),
        "exercises": len(nav_exercises),
        "docs": len(nav_docs),
        "unlinked": links.unlinked,
    }


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def leaked_markers(folder: Path) -> list[str]:
    """Files under ``folder`` that hold an nbgrader solution or hidden-test marker."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".md", ".ipynb", ".html", ".json", ".js", ".txt", ".xml"):
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path}: {marker}" for marker in LEAK_MARKERS if marker in text]
    return found


def build(root: Path = ROOT, dest: Path = BUILD) -> Path:
    """Stage, then run MkDocs; return the built site's folder (``dest``/html)."""
    start = time.monotonic()
    staged = stage(root, dest)
    command = [sys.executable, "-m", "mkdocs", "build", "--clean", "--config-file", str(dest / "mkdocs.yml")]
    result = subprocess.run(command, cwd=dest, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"mkdocs build failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    warnings = [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    html = dest / "html"
    leaks = leaked_markers(html)
    if leaks:
        raise SystemExit("the built site publishes solutions or hidden tests:\n" + "\n".join(leaks))
    print(
        f"site: {staged['lessons']} lessons, {staged['exercises']} exercises, {staged['docs']} docs pages "
        f"-> {html} in {time.monotonic() - start:.1f} s"
    )
    for line in warnings:
        print(f"  mkdocs: {line}")
    for link in staged["unlinked"]:
        print(f"  not on the site, shown as text: {link}")
    return html


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_tools.site", description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="build", choices=["build", "stage"])
    parser.add_argument("--out", type=Path, default=BUILD, help="build folder (default build/site)")
    args = parser.parse_args(argv)
    if args.command == "stage":
        print(stage(ROOT, args.out.resolve()))
    else:
        build(ROOT, args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
