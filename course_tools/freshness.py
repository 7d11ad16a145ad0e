"""Whether a lesson's committed outputs still belong to the code that produced them.

A lesson's outputs come from its own cells, from the ``course_lib`` modules it runs (imported, or
started as ``python -m course_lib...`` / ``"course_lib.x:fn"`` strings) with everything those import,
and from the pinned libraries. ``library_stamp`` fingerprints the second and third; ``nbtools
execute`` stores it beside the cells' hash and ``stale_modules`` names what changed since. A module's
fingerprint is its syntax tree without docstrings, so a comment or docstring edit keeps outputs fresh
and any change of code does not.

``unexplained_stderr`` holds a fresh execution's stderr to the explanations in
``tests/explained_stderr.toml``: a warning nobody explained fails the execution.
"""

from __future__ import annotations

import ast
import hashlib
import re
import tomllib
from importlib import metadata
from pathlib import Path

import nbformat

PACKAGE = "course_lib"
ROOT = Path(__file__).resolve().parents[1]
EXPLAINED_STDERR = ROOT / "tests" / "explained_stderr.toml"
# The libraries whose behaviour the lessons' outputs show; their versions are part of the stamp.
PINNED = ("torch", "transformers", "accelerate", "datasets", "bitsandbytes")
# A course_lib module named in a string: `python -m course_lib.cli.train`, "course_lib.apparatus.x:fn".
_NAMED = re.compile(r"\bcourse_lib(?:\.[A-Za-z_]\w*)+")


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module ``name`` (dotted, starting with course_lib) under ``root``, or None."""
    path = root.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _resolve(name: str, root: Path) -> str | None:
    """The longest prefix of ``name`` that is a course_lib module (``a.b.fn`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        if _module_file(".".join(parts), root) is not None:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(tree: ast.AST, module: str, is_package: bool, root: Path) -> set[str]:
    """Every course_lib module that ``tree`` imports, at any depth (function bodies included)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = _NAMED.findall(node.value)
        else:
            continue
        for name in names:
            if name.split(".")[0] == PACKAGE and (resolved := _resolve(name, root)):
                found.add(resolved)
    return found


def _code_of(nb: nbformat.NotebookNode) -> str:
    """The notebook's code cells as Python (shell escapes and magics dropped)."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            lines += [ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("!", "%"))]
            lines.append("")
    return "\n".join(lines)


def lesson_modules(nb: nbformat.NotebookNode, root: Path = ROOT) -> list[str]:
    """The course_lib modules ``nb`` runs, with every course_lib module they import, sorted."""
    code = _code_of(nb)
    try:
        todo = _imports(ast.parse(code), "__main__", False, root)
    except SyntaxError:  # a cell that is not plain Python: fall back to the names it mentions
        todo = {m for name in _NAMED.findall(code) if (m := _resolve(name, root))}
    raw = "\n".join(c.source for c in nb.cells if c.cell_type == "code")  # `!python -m ...` too
    todo |= {m for name in _NAMED.findall(raw) if (m := _resolve(name, root))}
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))} - seen  # parents run first
        path = _module_file(name, root)
        tree = _strip_docstrings(ast.parse(path.read_text()))  # a docstring's example runs nothing
        todo |= _imports(tree, name, path.name == "__init__.py", root) - seen
    return sorted(seen)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def module_fingerprint(path: Path) -> str:
    """Hash of a module's code: its syntax tree without docstrings (comments never reach the tree)."""
    tree = _strip_docstrings(ast.parse(path.read_text()))
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:12]


def _assets_fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted((root / PACKAGE / "assets").rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def library_stamp(nb: nbformat.NotebookNode, root: Path = ROOT) -> dict[str, str]:
    """Fingerprint of what ``nb``'s outputs depend on besides its cells: module -> hash, library -> version."""
    stamp = {name: module_fingerprint(_module_file(name, root)) for name in lesson_modules(nb, root)}
    if f"{PACKAGE}.models" in stamp or f"{PACKAGE}.corpus" in stamp:
        stamp[f"{PACKAGE}/assets"] = _assets_fingerprint(root)
    for lib in PINNED:
        try:
            stamp[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            stamp[lib] = "not installed"
    return stamp


def stale_modules(nb: nbformat.NotebookNode, root: Path = ROOT) -> list[str] | None:
    """What changed since ``nb`` was executed (module or library names); None if never stamped."""
    stamped = nb.metadata.get("course", {}).get("library")
    if stamped is None:
        return None
    now = library_stamp(nb, root)
    return sorted(k for k in stamped.keys() | now.keys() if stamped.get(k) != now.get(k))


def explanations(path: Path = EXPLAINED_STDERR) -> list[dict[str, str]]:
    """The explained stderr entries: ``pattern`` (a regex), ``why``, optional ``lessons`` (file names)."""
    entries = tomllib.loads(path.read_text()).get("stderr", [])
    for entry in entries:
        if not entry.get("pattern") or not entry.get("why"):
            raise ValueError(f"{path}: every [[stderr]] entry needs a pattern and a why: {entry}")
        re.compile(entry["pattern"])
    return entries


def is_explained(text: str, lesson: str, entries: list[dict[str, str]]) -> bool:
    """Whether one stderr output ``text`` of ``lesson`` matches an explanation meant for it."""
    return any(re.search(e["pattern"], text) and lesson in e.get("lessons", [lesson]) for e in entries)


def unexplained_stderr(nb: nbformat.NotebookNode, lesson: str, path: Path = EXPLAINED_STDERR) -> list[str]:
    """``"cell N: first line"`` for each stderr output of ``nb`` that no explanation matches."""
    entries, found = explanations(path), []
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                if not is_explained(out.get("text", ""), lesson, entries):
                    first = next((ln for ln in out.get("text", "").splitlines() if ln.strip()), "")
                    found.append(f"cell {index}: {first[:200]}")
    return found
