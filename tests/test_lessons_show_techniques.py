"""Each lesson runs the code of its technique in its own cells (STYLE.md items 2 and 4); the library's
apparatus only measures around it.

- every lesson's executed code cells contain the calls that apply its technique (TECHNIQUE_CALLS);
- a function in ``course_lib/apparatus/`` that builds a wrapper or an efficient optimizer, or calls a
  collective, is shown verbatim by a lesson (defined in a code cell, or printed with inspect.getsource);
- a function or class a lesson defines under the name of a ``course_lib`` one is, line for line, the
  library's (the spawned workers run the library's copy: the learner reads what runs);
- every public name in ``course_lib`` names one thing.
"""

import ast
import re
import textwrap
from functools import cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "course_lib"
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Regular expressions, each of which must match some executed code cell of the lesson.
TECHNIQUE_CALLS = {
    "02_distributed_concepts": [r"all_reduce\(", r"DistributedDataParallel\("],
    "03_mixed_precision": [r"torch\.autocast\(", r"GradScaler\(", r"scaler\.scale\(", r"scaler\.unscale_\("],
    "04_accumulation_checkpointing": [
        r"accelerator\.accumulate\(",
        r"\.backward\(\)",
        r"model_accepts_loss_kwargs\s*=\s*False",
        r"checkpoint_sequential\(",
        r"torch\.utils\.checkpoint\.checkpoint\(|\bcheckpoint\(",
    ],
    "05_local_sgd": [
        r"DistributedDataParallel\(",
        r"\.no_sync\(\)",
        r"LocalSGD\(",
        r"local_sgd\.step\(\)",
        r"register_comm_hook\(",
    ],
    "06_efficient_optimizers": [
        r"torch\.optim\.AdamW\(",
        r"torch\.optim\.Adafactor\(",
        r"AdamW8bit\(",
        r"\.state\[",
    ],
    "06b_memory_and_sharding": [
        r"DistributedDataParallel\(",
        r"ZeroRedundancyOptimizer\(",
        r"fully_shard\(",
        r"def \w*saved\w*\(",
    ],
    "07_time_to_accuracy": [
        r"DataCollatorWithPadding\(|pad_to_multiple_of",
        r"TrainConfig\(",
        r"def decide\(",
    ],
}

# Calls that apply a technique: building a wrapper or an efficient optimizer, or a collective.
TECHNIQUE_NAMES = re.compile(
    r"^(DistributedDataParallel|fully_shard|ZeroRedundancyOptimizer|LocalSGD|Adafactor|AdamW8bit"
    r"|all_reduce\w*|all_gather\w*|broadcast\w*|reduce_scatter\w*)$"
)


@cache
def lesson(path: Path):
    return nbformat.read(path, as_version=4)


def code_sources(nb, executed_only: bool = True) -> list[str]:
    """The lesson's code cells (executed ones: they have an execution count), without IPython magics."""
    return [
        "\n".join(ln for ln in c.source.splitlines() if not ln.lstrip().startswith(("%", "!")))
        for c in nb.cells
        if c.cell_type == "code" and (c.get("execution_count") is not None or not executed_only)
    ]


def output_texts(nb) -> list[str]:
    texts = []
    for c in nb.cells:
        for out in c.get("outputs", []):
            texts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return texts


@pytest.mark.parametrize("name", sorted(TECHNIQUE_CALLS))
def test_a_lesson_runs_its_technique_in_its_own_cells(name):
    path = ROOT / "notebooks" / f"{name}.ipynb"
    cells = code_sources(lesson(path))
    missing = [p for p in TECHNIQUE_CALLS[name] if not any(re.search(p, src) for src in cells)]
    assert not missing, f"{path.name}: no executed code cell matches {missing}"


def test_every_lesson_with_a_technique_is_listed():
    listed = set(TECHNIQUE_CALLS)
    assert listed <= {p.stem for p in LESSONS}, sorted(listed - {p.stem for p in LESSONS})
    for needed in ("04", "05", "06_", "06b", "07"):
        assert any(n.startswith(needed) for n in listed), needed


def technique_calls(node: ast.AST) -> list[str]:
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if TECHNIQUE_NAMES.match(name):
                found.append(name)
    return found


def apparatus_functions_applying_a_technique(source: str) -> list[tuple[str, str, list[str]]]:
    """(name, source, calls) of each top-level function or class that applies a technique."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if calls := technique_calls(node):
                found.append((node.name, ast.get_source_segment(source, node), sorted(set(calls))))
    return found


def shown_verbatim(segment: str, sources: list[str], outputs: list[str]) -> bool:
    segment = textwrap.dedent(segment).strip()
    return any(segment in textwrap.dedent(s) for s in sources) or any(segment in o for o in outputs)


def test_the_apparatus_applies_no_technique_that_no_lesson_shows():
    sources = [src for p in LESSONS for src in code_sources(lesson(p))]
    outputs = [o for p in LESSONS for o in output_texts(lesson(p))]
    hidden = []
    for path in sorted((PKG / "apparatus").glob("*.py")):
        for name, segment, calls in apparatus_functions_applying_a_technique(path.read_text()):
            if not shown_verbatim(segment, sources, outputs):
                hidden.append(f"{path.relative_to(ROOT)}:{name} ({', '.join(calls)})")
    assert not hidden, (
        "apparatus code that applies a technique no lesson shows (define it in a lesson cell exactly as "
        "in the library, or move the technique's lines into the lesson): " + "; ".join(hidden)
    )


def test_the_apparatus_check_flags_a_hidden_wrapper_and_passes_a_shown_one():
    library = (
        "def wrap(model):\n    return DistributedDataParallel(model)\n\ndef count(x):\n    return len(x)\n"
    )
    (found,) = apparatus_functions_applying_a_technique(library)
    assert found[0] == "wrap" and found[2] == ["DistributedDataParallel"]
    assert not shown_verbatim(found[1], ["import torch\nwrap(model)"], [])
    assert shown_verbatim(found[1], ["import torch\n\n" + found[1] + "\n\nwrap(m)"], [])
    assert shown_verbatim(found[1], [], ["source:\n" + found[1] + "\n"])
    changed = found[1].replace("model)", "model, bucket_cap_mb=1)")
    assert not shown_verbatim(found[1], [changed], [])


def public_definitions() -> dict[str, list[str]]:
    """Every public top-level name defined in course_lib -> the modules that define it."""
    names: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined = [node.name]
            elif isinstance(node, ast.Assign):
                defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined = [node.target.id]
            else:
                continue
            for name in defined:
                if not name.startswith("_"):
                    names.setdefault(name, []).append(module)
    return names


# A command-line module's entry points are named by convention (`python -m course_lib.cli.X` calls main).
CLI_ENTRY_POINTS = {"main", "parse_args"}


def test_every_public_name_in_course_lib_names_one_thing():
    clashes = {
        name: modules
        for name, modules in public_definitions().items()
        if len(modules) > 1
        and not (name in CLI_ENTRY_POINTS and all(m.startswith("course_lib.cli.") for m in modules))
    }
    assert not clashes, f"public names defined more than once (rename one, or import the one): {clashes}"


def library_definitions() -> dict[str, str]:
    """Public name -> its source segment, for every top-level function and class in course_lib."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, ast.get_source_segment(source, node))
    return found


def lesson_definitions(sources: list[str]) -> list[tuple[str, str]]:
    found = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                found.append((node.name, ast.get_source_segment(src, node)))
    return found


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_that_defines_a_library_name_shows_the_library_lines(path):
    library = library_definitions()
    for name, segment in lesson_definitions(code_sources(lesson(path), executed_only=False)):
        if name in library:
            assert segment == library[name], (
                f"{path.name} defines {name}, which differs from course_lib's {name}: copy the library's "
                "lines into the lesson (or change both), so the lesson shows what the course runs."
            )


def test_the_mirror_check_sees_a_changed_line():
    library = library_definitions()
    assert "train_pytorch" in library
    changed = library["train_pytorch"].replace("scaler.update()", "pass")
    ((name, segment),) = lesson_definitions([changed])
    assert name == "train_pytorch" and segment != library[name]
