"""The site's pages as Markdown: a notebook with its committed outputs, a lesson's and an exercise's page.

Nothing is executed: a code cell becomes fenced Python, its committed outputs follow it (text as text,
a plot as the PNG it stored, written beside the page, a widget as the note ``nbtools`` stored for it).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from course_tools.site_markdown import LinkMap, jupyter_to_mkdocs

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
IMAGES = {"image/png": "png", "image/svg+xml": "svg"}


def title_of(cells: list[dict]) -> str:
    """The notebook's first level-1 heading."""
    for cell in cells:
        if cell["cell_type"] == "markdown":
            found = re.search(r"^# +(.+?) *$", source(cell), re.M)
            if found:
                return found.group(1)
    raise ValueError("the notebook has no level-1 heading ('# ...') to title its page with")


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def fenced(text: str, info: str) -> str:
    """``text`` in a fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{info}\n{text.rstrip()}\n{ticks}"


def terminal_text(text: str) -> str:
    """What a terminal would show: colour codes dropped, a line redrawn with \\r shown as last drawn."""
    text = ANSI.sub("", text)
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def output_markdown(output: dict, image_path: Path, image_link: str, links: LinkMap, where: tuple) -> str:
    """One committed output as Markdown; a plot is written to ``image_path`` and linked as ``image_link``."""
    kind = output["output_type"]
    if kind == "stream":
        style = ".nb-stderr" if output.get("name") == "stderr" else ".nb-output"
        return fenced(terminal_text(source({"source": output.get("text", "")})), f"{{.text {style}}}")
    if kind == "error":
        return fenced(terminal_text("\n".join(output.get("traceback", []))), "{.text .nb-stderr}")
    data = output.get("data", {})
    for mime, extension in IMAGES.items():
        if mime in data:
            payload = source({"source": data[mime]})
            image_path = image_path.with_suffix(f".{extension}")
            image_path.parent.mkdir(parents=True, exist_ok=True)
            if extension == "png":
                image_path.write_bytes(base64.b64decode(payload))
            else:
                image_path.write_text(payload)
            return f"![{where[0]} の図]({Path(image_link).with_suffix(f'.{extension}').as_posix()})"
    if "text/markdown" in data:
        return jupyter_to_mkdocs(links.rewrite(source({"source": data["text/markdown"]}), *where[1:]))
    if "text/html" in data:
        return f'<div class="nb-html" markdown="0">\n{source({"source": data["text/html"]})}\n</div>'
    if "text/plain" in data:
        return fenced(terminal_text(source({"source": data["text/plain"]})), "{.text .nb-output}")
    return ""


def notebook_markdown(nb: dict, repo_path: str, page: str, out_dir: Path, links: LinkMap, after_first=""):
    """The notebook as Markdown for ``page``; plots go to ``out_dir``/img/. ``after_first``: text put
    after the first Markdown cell (the title and summary)."""
    stem = Path(page).stem
    parts, code_number, placed = [], 0, not after_first
    for cell in nb["cells"]:
        text = source(cell)
        if cell["cell_type"] == "markdown":
            parts.append(jupyter_to_mkdocs(links.rewrite(text, repo_path, page)))
            if not placed:
                parts.append(after_first)
                placed = True
        elif cell["cell_type"] == "code":
            code_number += 1
            if text.strip():
                parts.append(fenced(text, "python"))
            for k, output in enumerate(cell.get("outputs", [])):
                name = f"img/{stem}-{code_number:03d}-{k}"
                where = (f"コードセル {code_number}", repo_path, page)
                parts.append(output_markdown(output, out_dir / name, name, links, where))
    if not placed:
        parts.insert(0, after_first)
    return "\n\n".join(part for part in parts if part) + "\n"


def lesson_box(notebook: str, exercises: list[tuple[str, str]], summary: str = "") -> str:
    """The box under a lesson's title: its exercise(s) and its notebook; then the lesson's English summary
    (``metadata.summary``: the learner's first screen is the Japanese card, the site keeps the English)."""
    name = Path(notebook).name
    lines = ['!!! abstract "このレッスンの演習とノートブック"', ""]
    if exercises:
        lines += [f"    - 演習: [{title}]({link})" for title, link in exercises]
    else:
        lines.append("    - 演習: このレッスンには演習がありません。")
    lines += [
        f"    - ノートブック: [{name}]({name})（ここに載せた出力つき。ダウンロードして JupyterLab で開けます）",
        f"    - 自分のマシンで実行: リポジトリで `make lab` を実行し、`notebooks/{name}` を開きます。",
        "    - このページの出力と図は、コミット済みのノートブックに保存された実行結果です（サイトの生成時には実行しません）。",
    ]
    if summary:
        lines += ["", '!!! note "English summary"', "", f"    {summary}"]
    return "\n".join(lines)


def exercise_box(notebook: str, lesson: tuple[str, str] | None, repo_path: str) -> str:
    """The box under an exercise's title: the lesson it practises, its notebook, how to check it."""
    name = Path(notebook).name
    lines = ['!!! abstract "この演習のノートブックとレッスン"', ""]
    if lesson:
        lines.append(f"    - レッスン: [{lesson[0]}]({lesson[1]})")
    lines += [
        f"    - 演習のノートブック: [{name}]({name})（解答とテストの隠し部分は含みません）",
        f"    - 自動採点の確認: `make check NB={repo_path}`",
    ]
    return "\n".join(lines)


def index_markdown(course_title: str, lessons: list[dict], docs: list[tuple[str, str]]) -> str:
    """The home page: Japanese first, each lesson with its exercise(s) and notebook, then the docs."""
    rows = []
    for lesson in lessons:
        exercise = "<br>".join(f"[{t}]({link})" for t, link in lesson["exercises"]) or "—"
        notebook = f"[{Path(lesson['notebook']).name}]({lesson['notebook']})"
        rows.append(f"| [{lesson['title']}]({lesson['page']}) | {exercise} | {notebook} |")
    doc_lines = [f"- [{title}]({page})" for title, page in docs] or ["- （まだありません）"]
    return "\n".join(
        [
            f"# {course_title}",
            "",
            "*Efficient AI Model Training with PyTorch*: 講義スライドに沿ったレッスン（日本語の解説、英語のコード）と、"
            "自動採点つきの演習です。GPU もインターネットも要りません。",
            "",
            "このサイトのレッスンは、コミット済みのノートブックを実行せずに載せたものです（出力と図は保存された実行結果）。"
            "自分のマシンで動かすには、リポジトリで `make lab` を実行し、JupyterLab で `notebooks/` のレッスンを開きます。"
            "演習は `exercises/` にあり、`make check NB=...` で自動採点を確かめられます。",
            "",
            "## レッスン",
            "",
            "| レッスン | 演習 | ノートブック |",
            "|---|---|---|",
            *rows,
            "",
            "## 資料（英語）",
            "",
            *doc_lines,
            "",
            "*English:* the lessons above are the course's notebooks with their committed outputs; each lesson's "
            "page links its exercise (the student release, without solutions or hidden tests) and its notebook.",
            "",
        ]
    )
