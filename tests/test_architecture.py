"""The shape of ``course_lib``: a module map that names every module, no import cycles, modules of a
readable size, and one training loop whose technique tags match its files."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "course_lib"
MAX_LINES = 400
TECHNIQUES = (
    "amp",
    "accelerator",
    "accum",
    "ddp",
    "clip",
    "resume",
    "optim",
    "activation_checkpointing",
    "local_sgd",
    "kernels",
    "fsdp",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}


def docstring(name: str) -> str:
    return ast.get_docstring(ast.parse(MODULES[name].read_text()), clean=False) or ""


def children(package: str) -> list[str]:
    """Modules and subpackages directly inside ``package`` (their last name part)."""
    depth = package.count(".") + 1
    return sorted(
        n.rsplit(".", 1)[1]
        for n in MODULES
        if n.startswith(package + ".") and n.count(".") == depth and not n.endswith("__main__")
    )


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_package_docstring_maps_its_modules(package):
    listed = set(re.findall(r"(?m)^ {0,4}([a-z_0-9]+)/? {2,}\S", docstring(package)))
    missing = sorted(set(children(package)) - listed)
    assert not missing, f"{package}'s docstring (its module map) does not name: {missing}"
    stale = sorted(listed - set(children(package)))
    assert not stale, f"{package}'s module map names modules that do not exist: {stale}"


def test_contributing_names_every_top_level_module_and_folder():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    missing = [c for c in children("course_lib") if not re.search(rf"`(course_lib/)?{c}\b", text)]
    assert not missing, f"CONTRIBUTING.md's layout does not name: {missing}"


def imports_of(name: str) -> set[str]:
    """Every course_lib module ``name`` imports, at module level or inside a function."""
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_not_even_through_imports_inside_functions():
    graph = {name: imports_of(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it by concern."


def test_the_loop_tags_every_technique_and_each_tag_has_its_file():
    loop = MODULES["course_lib.training.loop"].read_text()
    code = loop.split('"""', 2)[2]  # after the docstring
    tags = set(re.findall(r"# \[(\w+)\]", code))
    assert tags == set(TECHNIQUES), f"tags in loop.py: {sorted(tags)}"
    for tag in TECHNIQUES:
        module = f"course_lib.training.{tag}"
        assert module in MODULES, f"# [{tag}] in loop.py, but no course_lib/training/{tag}.py"
        assert docstring(module).startswith(f"[{tag}]"), f"{module}'s docstring starts with [{tag}]"
        assert (
            module in imports_of("course_lib.training.loop")
            or tag == "resume"
            or any(m.startswith(module) for m in imports_of("course_lib.training.loop"))
        )


def test_the_loop_has_no_branch_per_technique():
    """The loop picks its steps once (Accelerator or plain PyTorch); no other branch on precision,
    scaler or accelerator: those live in the technique files."""
    tree = ast.parse(MODULES["course_lib.training.loop"].read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    technique_words = {"accelerator", "scaler", "precision", "no_sync", "sampler"}
    branching = [
        ast.unparse(n.test)
        for n in ast.walk(train)
        if isinstance(n, ast.If | ast.IfExp)
        and technique_words
        & {x.id if isinstance(x, ast.Name) else getattr(x, "attr", "") for x in ast.walk(n.test)}
    ]
    assert branching == ["accelerator is not None"], branching


def test_the_top_level_map_leaves_folder_contents_to_the_folders_own_maps():
    """A second list of a folder's modules drifts (it named 6 of 9 techniques): one map per folder."""
    for line in docstring("course_lib").splitlines():
        match = re.match(r"^([a-z_]+)/ {2,}(.*)$", line)
        if match:
            named = set(re.findall(r"[a-z_]+", match.group(2))) & set(
                children(f"course_lib.{match.group(1)}")
            )
            assert not named, f"course_lib's map lists modules of {match.group(1)}/ ({sorted(named)})"


REFERENCE = re.compile(
    r"(?<![\w/.-])((?:course_lib|course_tools|tests|docs|notebooks|solutions|exercises|scripts|jupyter)/[\w./-]*\w)"
)


def test_every_path_the_code_and_docs_name_exists():
    """Cross-references that name a file or folder of the repository point at one that exists."""
    texts = [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").rglob("*.md")]
    texts += [
        ROOT / n for n in ("README.md", "CONTRIBUTING.md", "Makefile", ".ci/run", "scripts/gpu_check.sh")
    ]
    missing = sorted(
        f"{path.relative_to(ROOT)}: {ref}"
        for path in texts
        for ref, end in ((m.group(1), m.end()) for m in REFERENCE.finditer(path.read_text()))
        if path.read_text()[end : end + 1] not in "*[<" and not (ROOT / ref).exists()
    )
    assert not missing, f"references to files that do not exist: {missing}"


# ---- the loop's backend protocol (course_lib/training/backend.py)


def _protocol_members() -> set[str]:
    from course_lib.training.backend import Backend

    methods = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    return methods | set(Backend.__annotations__)


def _backend_uses(module: str, function: str, name: str = "backend") -> set[str]:
    """The attributes ``function`` in ``module`` reads or calls on its variable ``name``."""
    tree = ast.parse(MODULES[module].read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    }


def test_the_backend_protocol_lists_exactly_what_the_loop_calls():
    used = _backend_uses("course_lib.training.loop", "train") | _backend_uses(
        "course_lib.training.clip", "clip_gradients"
    )
    members = _protocol_members()
    assert used - members == set(), f"the loop calls members Backend does not list: {sorted(used - members)}"
    assert members - used == set(), f"Backend lists members nothing calls: {sorted(members - used)}"
    assert len(members) == 10  # seven calls and three attributes, as loop.py's docstring says
    loop_doc = docstring("course_lib.training.loop")
    assert "seven calls" in loop_doc and "three attributes" in loop_doc


def test_the_loop_reaches_its_backend_only_by_the_name_backend():
    """A second name for the backend would hide its calls from the protocol check above."""
    tree = ast.parse(MODULES["course_lib.training.loop"].read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    constructed = {
        t.id if isinstance(t, ast.Name) else t.target.id
        for n in ast.walk(train)
        if isinstance(n, ast.Assign | ast.AnnAssign)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "id", "") in ("TorchAmp", "AcceleratorSteps")
        for t in (n.targets if isinstance(n, ast.Assign) else [n])
    }
    assert constructed == {"backend"}, constructed


def test_both_backends_implement_the_protocol_with_the_same_signatures():
    import inspect
    from types import SimpleNamespace

    import torch

    from course_lib.training.accelerator import AcceleratorSteps
    from course_lib.training.amp import TorchAmp
    from course_lib.training.backend import Backend

    fake = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", is_main_process=True)
    backends = [TorchAmp(torch.device("cpu"), "no"), AcceleratorSteps(fake)]
    for backend in backends:
        missing = sorted(m for m in _protocol_members() if not hasattr(backend, m))
        assert not missing, f"{type(backend).__name__} lacks {missing}"
        assert isinstance(backend, Backend)
        for name in _protocol_members():
            if callable(getattr(Backend, name, None)):
                want = list(inspect.signature(getattr(Backend, name)).parameters)
                have = list(inspect.signature(getattr(type(backend), name)).parameters)
                assert have == want, f"{type(backend).__name__}.{name}{have} differs from Backend's {want}"


def test_the_protocol_check_catches_a_missing_method():
    from course_lib.training.backend import Backend

    class NoUnscale:
        device, precision, is_main_process = None, "no", True

        def prepare(self, model, optimizer, train_dataloader, eval_dataloader): ...
        def to_device(self, batch): ...
        def autocast(self): ...
        def backward(self, loss): ...
        def step(self, optimizer, history): ...
        def eval_args(self): ...

    assert not isinstance(NoUnscale(), Backend)
    NoUnscale.unscale = lambda self, optimizer: None
    assert isinstance(NoUnscale(), Backend)


CONTRIBUTING_ROW = re.compile(
    r"^\| `((?:course_lib|course_tools)/(?:\*\.py|[a-z_]+/)?)` \|[^|]*\| (.*) \|$", re.M
)


def contributing_modules() -> dict[str, set[str]]:
    """CONTRIBUTING's layout table: for each folder row, the modules its last column names."""
    rows = {}
    for folder, cell in CONTRIBUTING_ROW.findall((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")):
        cell = re.sub(r"\([^()]*\)", "", cell)  # what a module is for, in parentheses, names no module
        rows[folder] = set(re.findall(r"`([a-z_0-9]+)`", cell))
    return rows


def modules_in(folder: str) -> set[str]:
    path = ROOT / folder.replace("*.py", "")
    return {p.stem for p in path.glob("*.py") if p.stem not in ("__init__", "__main__")}


def test_contributing_lists_each_folders_modules_both_ways():
    rows = contributing_modules()
    assert {"course_lib/*.py", "course_lib/training/", "course_tools/"} <= set(rows), sorted(rows)
    for folder, listed in rows.items():
        assert listed == modules_in(folder), (
            f"CONTRIBUTING.md's row for {folder}: missing {sorted(modules_in(folder) - listed)}, "
            f"names modules that do not exist {sorted(listed - modules_in(folder))}"
        )
