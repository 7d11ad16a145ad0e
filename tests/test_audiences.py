"""Two packages by audience: ``course_lib`` for learners, ``course_tools`` for maintainers beside it.

``course_lib`` is what a lesson imports or the README tells a learner to run; ``course_tools`` (release,
grading, generated sections, notebook upkeep, asset builds) imports it, never the other way round.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEARNER, MAINTAINER = "course_lib", "course_tools"


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def maintainer_imports(package: Path) -> list[str]:
    return sorted(
        f"{path.relative_to(package.parent)}: {name}"
        for path in package.rglob("*.py")
        for name in imported_modules(path)
        if name == MAINTAINER or name.startswith(MAINTAINER + ".")
    )


def test_course_lib_imports_nothing_of_the_maintainers_package():
    assert maintainer_imports(ROOT / LEARNER) == []


def test_the_check_catches_an_import_of_the_maintainers_package(tmp_path):
    pkg = tmp_path / LEARNER
    pkg.mkdir()
    (pkg / "demo.py").write_text("def f():\n    from course_tools.sections import write_block\n")
    assert maintainer_imports(pkg) == [f"{LEARNER}/demo.py: course_tools.sections"]


def modules(package: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__")


def test_the_maintainers_package_maps_its_modules_both_ways():
    doc = ast.get_docstring(ast.parse((ROOT / MAINTAINER / "__init__.py").read_text(encoding="utf-8")))
    listed = set(re.findall(r"(?m)^([a-z_0-9]+) {2,}\S", doc))
    assert listed == set(modules(MAINTAINER))


@pytest.mark.parametrize("name", ["release", "nbtools", "sections", "experiments", "build_assets"])
def test_no_maintainer_tool_is_left_in_course_lib(name):
    """The learner's package holds no copy of a maintainer tool (a move, not a duplicate)."""
    assert not list((ROOT / LEARNER).rglob(f"{name}.py"))


def test_the_learners_commands_write_no_readme():
    """``bench`` and ``recipe`` measure and write their record; only course_tools writes README sections."""
    for name in ("bench", "recipe"):
        source = (ROOT / LEARNER / "cli" / f"{name}.py").read_text(encoding="utf-8")
        assert "--readme" not in source and "write_block" not in source, name
