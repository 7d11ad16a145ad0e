"""Generated sections of the course's markdown files: one writer each, rendered from a committed record.

A generated block lies between two marker lines, each alone on its line, exactly once in its file and
outside ``` code fences::

    <!-- NAME:start -->
    ... written by a command, never by hand ...
    <!-- NAME:end -->

Every block is rendered from a record committed in ``docs/results/`` (what was measured, on which
machine, when), so it can be written again without measuring, and checked for drift:

    python -m course_tools.sections check         # exit 1 when a block differs from what its record renders
    python -m course_tools.sections render bench  # write a block again from its record (no measuring)
    python -m course_tools.sections list          # which command writes which block, from which record

A section's text comes from a function of ``course_lib`` (the same report a learner's command prints)
or of this package; ``find_block``, ``replace_block``, ``write_block`` and ``check_block`` are the only
code that handles marker lines. ``course_lib`` never imports this module: its commands measure and
write a record (``--json``), and this module puts the record into the files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from course_lib.benchmark.report import save_record

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class SectionError(ValueError):
    """A file's marker lines are missing, repeated, out of order or inside a code fence."""


def markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of block ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def fenced(lines: list[str]) -> list[bool]:
    """For each line, whether it belongs to a fenced code block (``` or ~~~), fence lines included."""
    inside, opening, flags = False, "", []
    for line in lines:
        match = _FENCE.match(line)
        if not inside and match:
            inside, opening = True, match.group(1)
            flags.append(True)
            continue
        if inside:
            flags.append(True)
            stripped = line.strip()
            if stripped and set(stripped) == {opening[0]} and len(stripped) >= len(opening):
                inside = False
            continue
        flags.append(False)
    return flags


@dataclass(frozen=True)
class Block:
    """Where block ``name`` lies in ``lines`` (``splitlines(keepends=True)`` of the text)."""

    name: str
    lines: tuple[str, ...]
    start: int  # index of the start marker line
    end: int  # index of the end marker line

    @property
    def body(self) -> str:
        """The text between the two marker lines."""
        return "".join(self.lines[self.start + 1 : self.end])


def find_block(text: str, name: str, where: str = "the file") -> Block:
    """Locate block ``name`` in ``text``; raise ``SectionError`` saying what to fix when it is malformed.

    Only a marker alone on its line counts (one quoted in prose is left alone); a marker line inside a
    code fence is refused, since markdown shows it there instead of hiding it.
    """
    lines = tuple(text.splitlines(keepends=True))
    in_fence = fenced(list(lines))
    start_marker, end_marker = markers(name)
    found: dict[str, list[int]] = {start_marker: [], end_marker: []}
    for i, line in enumerate(lines):
        if line.strip() in found:
            found[line.strip()].append(i)
    for marker, at in found.items():
        for i in at:
            if in_fence[i]:
                raise SectionError(
                    f"{where}, line {i + 1}: the marker line '{marker}' is inside a ``` code block. Move the "
                    f"generated '{name}' section out of the code block: markers must be alone on their line, "
                    "outside code fences."
                )
    starts, ends = found[start_marker], found[end_marker]
    if not starts and not ends:
        raise SectionError(
            f"{where} has no '{name}' section: add the two marker lines '{start_marker}' and '{end_marker}', "
            "each alone on its own line and outside code blocks, where the generated section should go, "
            "then run again."
        )
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        lines_at = ", ".join(
            f"{m} at line(s) {', '.join(str(i + 1) for i in at) or 'none'}" for m, at in found.items()
        )
        raise SectionError(
            f"{where} needs exactly one '{start_marker}' line followed by one '{end_marker}' line (found "
            f"{lines_at}): keep one pair, start before end, and delete the other marker lines."
        )
    return Block(name, lines, starts[0], ends[0])


def _normalize(body: str) -> str:
    body = body.strip()
    return body + "\n" if body else ""


def replace_block(text: str, name: str, body: str, where: str = "the file") -> str:
    """``text`` with block ``name``'s body replaced by ``body`` (marker lines and the rest unchanged)."""
    block = find_block(text, name, where)
    return "".join([*block.lines[: block.start + 1], _normalize(body), *block.lines[block.end :]])


def read_block(path: str | Path, name: str) -> str:
    """The body of block ``name`` in the file at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the file that holds the '{name}' section.")
    return find_block(path.read_text(encoding="utf-8"), name, str(path)).body


def write_block(path: str | Path, name: str, body: str) -> bool:
    """Put ``body`` between block ``name``'s markers in ``path``; return whether the file changed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the file that holds the '{name}' section.")
    text = path.read_text(encoding="utf-8")
    new = replace_block(text, name, body, str(path))
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def first_difference(current: str, expected: str) -> str:
    """``line N: committed '...', rendered '...'`` for the first line where the two texts differ."""
    a, b = current.splitlines(), expected.splitlines()
    for i in range(max(len(a), len(b))):
        left = a[i] if i < len(a) else "(nothing)"
        right = b[i] if i < len(b) else "(nothing)"
        if left != right:
            return f"line {i + 1} of the block: committed {left!r}, rendered {right!r}"
    return "only blank lines or line ends differ"


def check_block(path: str | Path, name: str, body: str, fix: str) -> str | None:
    """None when block ``name`` in ``path`` holds exactly ``body``; else what differs and the fix."""
    current = read_block(path, name)
    expected = _normalize(body)
    if current == expected:
        return None
    return (
        f"{path}: the '{name}' section differs from what its record renders ({first_difference(current, expected)}). "
        f"Re-render it with `{fix}` (no measuring); if the committed numbers are the right ones, the record "
        "is stale: measure again with the writer instead of editing the section by hand."
    )


def load_record(path: str | Path, measure: str) -> dict:
    """The JSON record at ``path``; a missing one raises an error naming the command that writes it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: measure and record it with `{measure}`.")
    return json.loads(path.read_text(encoding="utf-8"))


# One writer of records: the learner's commands write theirs with it too (--json).
write_record = save_record


# ----------------------------------------------------------------------------------------------
# The generated sections of this repository


@dataclass(frozen=True)
class Generated:
    """One kind of generated section: where it lives, its record, how it is measured and rendered."""

    name: str
    files: tuple[str, ...]
    record: str
    measure: str  # measure, write the record, render
    renderer: str = ""  # "module:function": the record -> the block's text, the same in every file
    checker: str = ""  # "module:function" with its own rules (lessons: README table and notebook headers)
    render_command: str = ""  # for a section with its own checker: how to re-render it

    @property
    def render(self) -> str:
        """Re-render the section from its record, no measuring."""
        return self.render_command or f"python -m course_tools.sections render {self.name}"


GENERATED: tuple[Generated, ...] = (
    Generated(
        "lessons",
        ("README.md", "notebooks/0*.ipynb (header sentence)"),
        "docs/results/lessons.json",
        "python -m course_tools.nbtools execute notebooks/*.ipynb --readme README.md",
        checker="course_tools.nbtools:check_committed",
        render_command="python -m course_tools.nbtools render notebooks/*.ipynb --readme README.md",
    ),
    Generated(
        "pretrained",
        ("docs/embedded.md",),
        "docs/results/pretrained.json",
        "python -m course_tools.experiments --json docs/results/pretrained.json"
        " && python -m course_tools.sections render pretrained",
        renderer="course_tools.experiments:render_report",
    ),
    Generated(
        "bench",
        ("docs/benchmark.md",),
        "docs/results/bench.json",
        "python -m course_lib.cli.bench --json docs/results/bench.json && python -m course_tools.sections render bench",
        renderer="course_lib.benchmark.report:report_from_record",
    ),
    Generated(
        "recipe",
        ("docs/recipe.md",),
        "docs/results/recipe.json",
        "python -m course_lib.cli.recipe --json docs/results/recipe.json"
        " && python -m course_tools.sections render recipe",
        renderer="course_lib.recipe_ladder.report:recipe_report",
    ),
    Generated(
        "mutation",
        ("docs/mutation.md",),
        "docs/results/mutation.json",
        "make mutation MODULES=<modules>  # measures, records and renders (course_tools/mutation.py)",
        renderer="course_tools.mutation:render_report",
    ),
)


def _function(spec: str) -> Callable:
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


def generated(name: str) -> Generated:
    """The generated section called ``name``; an unknown name raises an error listing the known ones."""
    for gen in GENERATED:
        if gen.name == name:
            return gen
    raise ValueError(f"no generated section {name!r}: use one of {', '.join(g.name for g in GENERATED)}.")


def rendered(gen: Generated, root: str | Path = ".") -> str:
    """The text ``gen``'s record under ``root`` renders (a missing record names its measuring command)."""
    return _function(gen.renderer)(load_record(Path(root) / gen.record, gen.measure))


def check_section(gen: Generated, root: str | Path = ".") -> list[str]:
    """What differs between ``gen``'s blocks under ``root`` and what its record renders (empty: none)."""
    if gen.checker:
        return _function(gen.checker)(Path(root))
    body = rendered(gen, root)
    problems = [check_block(Path(root) / name, gen.name, body, gen.render) for name in gen.files]
    return [p for p in problems if p]


def render_section(gen: Generated, root: str | Path = ".") -> list[str]:
    """Write ``gen``'s blocks under ``root`` from its record; the files that changed."""
    if gen.checker:
        raise ValueError(f"the {gen.name} section has its own writer: run `{gen.render}`.")
    body = rendered(gen, root)  # every file's markers are read before any is written
    paths = [Path(root) / name for name in gen.files]
    for path in paths:
        read_block(path, gen.name)
    return [str(path) for path in paths if write_block(path, gen.name, body)]


def check_all(root: str | Path = ".", sections: tuple[Generated, ...] | list = GENERATED) -> list[str]:
    """Every problem of the generated ``sections`` under ``root`` (empty when all are up to date)."""
    problems = []
    for gen in sections:
        try:
            problems += check_section(gen, root)
        except (ValueError, FileNotFoundError, KeyError) as err:
            problems.append(f"{gen.name}: {err}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.sections", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=["check", "list", "render"])
    parser.add_argument("names", nargs="*", help="render: the sections to write (check: all by default)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (default: here)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for gen in GENERATED:
            print(
                f"{gen.name}: {', '.join(gen.files)}\n  record:  {gen.record}\n  render:  {gen.render}\n"
                f"  measure: {gen.measure}"
            )
        return 0
    try:
        chosen = [generated(name) for name in args.names]
        if args.command == "render":
            if not chosen:
                raise ValueError(f"name the sections to render, from {', '.join(g.name for g in GENERATED)}.")
            for gen in chosen:
                changed = render_section(gen, args.root)
                print(f"{gen.name}: {', '.join(changed) if changed else 'already up to date'}")
            return 0
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problems = check_all(args.root, chosen or GENERATED)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("generated sections: all up to date with their records")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
