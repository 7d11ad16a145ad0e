"""Each measured quantity is defined once (issue #23): one module holds it, every other module calls it.

``INSTRUMENTS`` lists the quantities the course measures and the one module that defines each. Two
checks keep it so, both by reading the source of ``course_lib`` (AST, never the docstrings):

* the names a quantity's module defines are defined nowhere else in ``course_lib``;
* no other module re-implements one: each ``RULE`` recognises the code a second implementation needs
  (a ``saved_tensors_hooks`` pack hook, a patch of a ``torch.distributed`` collective, an
  ``element_size()`` byte sum, ...) and names the one module allowed to hold it.

Each rule is shown to fire on a small duplicate (``test_each_rule_finds_a_duplicate``), so none of
these tests passes because a rule can no longer see anything.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"

# quantity -> (the module that defines it, the names it defines there)
INSTRUMENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bytes saved for backward": ("instruments/memory.py", ("SavedTensors", "saved_tensor_bytes")),
    "optimizer-state bytes": (
        "instruments/memory.py",
        ("optimizer_state_bytes", "optimizer_state_bytes_by_key"),
    ),
    "model states (weights, gradients, optimizer state)": ("instruments/memory.py", ("model_state_bytes",)),
    "bytes of tensors": ("instruments/memory.py", ("tensor_bytes",)),
    "peak memory": ("instruments/memory.py", ("TensorPeak", "tensor_peak_mb")),
    "step time": ("instruments/timing.py", ("Stopwatch", "time_fn", "StepClock")),
    "throughput and MFU": ("instruments/throughput.py", ("matmul_gflops", "model_flops_per_token", "mfu")),
    "all-reduce / collective bytes": (
        "instruments/comm.py",
        ("CollectiveLog", "counting_collectives", "ring_bytes"),
    ),
    "padding counts (real vs padded tokens)": ("data.py", ("padding_counts",)),
    "steps per epoch": ("training/accum.py", ("steps_per_epoch",)),
    "Accelerate state reset": ("training/accelerator.py", ("reset_accelerate_state",)),
    "comm-hook names": ("training/ddp.py", ("COMM_HOOKS",)),
    "dtype names and aliases": ("floats.py", ("FORMATS", "format_name")),
}


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


SOURCES = _sources()


# --- what a second implementation looks like ---------------------------------------------------


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain (``""`` for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _dist_names(tree: ast.AST) -> set[str]:
    """The names a module gives ``torch.distributed`` (``dist``, ``torch.distributed``, ...)."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
}


def _saved_tensors_hooks(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "saved_tensors_hooks") or (
            isinstance(node, ast.Name) and node.id == "saved_tensors_hooks"
        ):
            yield node.lineno
        elif isinstance(node, ast.ImportFrom) and any(a.name == "saved_tensors_hooks" for a in node.names):
            yield node.lineno


def _collective_patches(tree: ast.AST) -> Iterator[int]:
    """Assigning to ``dist.<anything>``, ``setattr(dist, ...)``, or keeping a collective aside to patch it."""
    dist = _dist_names(tree)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and _dotted(target.value) in dist:
                yield node.lineno
        if isinstance(node, ast.Call) and _dotted(node.func) in {"setattr", "monkeypatch.setattr"}:
            if node.args and _dotted(node.args[0]) in dist:
                yield node.lineno
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            if _dotted(node.value.value) in dist and node.value.attr in COLLECTIVES:
                yield node.lineno  # _REAL_ALL_REDUCE = dist.all_reduce: a patch's other half


def _byte_sums(tree: ast.AST) -> Iterator[int]:
    """``t.element_size()`` or ``t.nbytes``: bytes of a tensor computed by hand (``tensor_bytes`` does it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"element_size", "nbytes"}:
            yield node.lineno


def _peak_memory(tree: ast.AST) -> Iterator[int]:
    counters = {"max_memory_allocated", "reset_peak_memory_stats", "max_memory_reserved", "ru_maxrss"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in counters:
            yield node.lineno
        elif isinstance(node, ast.keyword) and node.arg == "profile_memory":
            yield node.value.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "VmHWM" in node.value:
            yield node.lineno


def _calls(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` calls a function or method named one of ``names``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name in names:
                return True
    return False


def _step_clocks(tree: ast.AST) -> Iterator[int]:
    """A loop that reads the clock and runs ``backward()``: a step timer of its own."""
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.While) and _calls(node, {"backward"}):
            if _calls(node, {"perf_counter", "time", "monotonic", "perf_counter_ns"}):
                yield node.lineno


def _mfu(tree: ast.AST) -> Iterator[int]:
    """A value stored under ``"mfu"`` that is not a call of ``instruments.throughput.mfu``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and str(key.value).lower() == "mfu":
                    if not (isinstance(value, ast.Call) and _dotted(value.func).split(".")[-1] == "mfu"):
                        yield value.lineno


def _collective_logs(tree: ast.AST) -> Iterator[int]:
    """A payload counted by hand: ``x.bytes += ...numel()`` (``CollectiveLog.record`` does it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and _calls(node.value, {"numel"}):
            if "bytes" in ast.unparse(node.target):  # log.bytes, sent["bytes"], self.bytes[kind]
                yield node.lineno


def _accelerate_reset(tree: ast.AST) -> Iterator[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "_reset_state":
            yield node.lineno


def _padding_counts(tree: ast.AST) -> Iterator[int]:
    """``batch["attention_mask"].sum()``: counting real tokens by hand."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sum":
            inner = node.func.value
            if isinstance(inner, ast.Subscript) and isinstance(inner.slice, ast.Constant):
                if inner.slice.value == "attention_mask":
                    yield node.lineno


def _ceil_division(node: ast.AST) -> ast.AST | None:
    """The divisor of ``math.ceil(a / b)`` or ``-(-a // b)``, else None."""
    if isinstance(node, ast.Call) and _dotted(node.func) in {"math.ceil", "ceil"} and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
            return arg.right
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = node.operand
        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.FloorDiv):
            if isinstance(inner.left, ast.UnaryOp) and isinstance(inner.left.op, ast.USub):
                return inner.right
    return None


def _steps_per_epoch(tree: ast.AST) -> Iterator[int]:
    """A ceiling division by the accumulation steps: optimizer steps per epoch, spelled again."""
    for node in ast.walk(tree):
        divisor = _ceil_division(node)
        if divisor is not None and "accum" in ast.unparse(divisor):
            yield node.lineno


def _dtype_aliases(tree: ast.AST) -> Iterator[int]:
    """A dict keyed by dtype names (``"bfloat16"``, ``"float16"``, ``"half"``): an alias table."""
    names = {"bfloat16", "float16", "float32", "half", "float"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys & names:
                yield node.lineno


def _hook_names(tree: ast.AST) -> Iterator[int]:
    """A table of comm-hook names: a ``*HOOK*`` constant spelled as a literal, or a name -> hook dict."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List | ast.Set):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any("HOOK" in n for n in names) and all(isinstance(e, ast.Constant) for e in node.value.elts):
                yield node.lineno
        elif isinstance(node, ast.Dict) and any(
            isinstance(v, ast.Attribute) and v.attr.endswith("_hook") for v in node.values
        ):
            yield node.lineno


@dataclass(frozen=True)
class Rule:
    quantity: str
    owners: tuple[str, ...]  # the module(s) allowed to hold such code
    find: Callable[[ast.AST], Iterator[int]]
    duplicate: str  # a small second implementation the rule must find


RULES = (
    Rule(
        "bytes saved for backward",
        ("instruments/memory.py",),
        _saved_tensors_hooks,
        "import torch\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack):\n    loss = f(x)\n",
    ),
    Rule(
        "collective bytes (patching torch.distributed)",
        ("instruments/comm.py",),
        _collective_patches,
        "import torch.distributed as dist\n_REAL = dist.all_reduce\ndist.all_reduce = counted\n",
    ),
    Rule(
        "collective bytes (a payload counted by hand)",
        ("instruments/comm.py",),
        _collective_logs,
        "def record(self, tensor):\n    self.bytes += tensor.numel() * 4\n",
    ),
    Rule(
        "bytes of tensors (optimizer state, model states, payloads)",
        ("instruments/memory.py",),
        _byte_sums,
        "total = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())\n",
    ),
    Rule(
        "peak memory",
        ("instruments/memory.py",),
        _peak_memory,
        "import torch\npeak = torch.cuda.max_memory_allocated()\n",
    ),
    Rule(
        "step time",
        ("instruments/timing.py",),
        _step_clocks,
        "import time\nfor batch in loader:\n    t = time.perf_counter()\n    model(batch).backward()\n",
    ),
    Rule("MFU", ("instruments/throughput.py",), _mfu, 'row = {"mfu": flops / (peak * 1e9)}\n'),
    Rule(
        "Accelerate state reset",
        ("training/accelerator.py",),
        _accelerate_reset,
        "from accelerate.state import AcceleratorState\nAcceleratorState._reset_state(True)\n",
    ),
    Rule(
        "padding counts",
        ("data.py",),
        _padding_counts,
        'real = int(batch["attention_mask"].sum())\n',
    ),
    Rule(
        "steps per epoch",
        ("training/accum.py",),
        _steps_per_epoch,
        "import math\nsteps = math.ceil(batches / cfg.grad_accum_steps) * cfg.epochs\n",
    ),
    Rule(
        "dtype names and aliases",
        ("floats.py",),
        _dtype_aliases,
        '_ALIASES = {"fp32": "no", "bfloat16": "bf16"}\n',
    ),
    Rule(
        "comm-hook names",
        ("training/ddp.py",),
        _hook_names,
        'HOOKS = ("fp32", "fp16", "bf16")\nhooks = {"fp32": default_hooks.allreduce_hook}\n',
    ),
)


def _code(source: str) -> ast.AST:
    """The module's AST without its docstrings (they may name what they do not do)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body[0] = ast.Pass()
    return tree


TREES = {path: _code(source) for path, source in SOURCES.items()}


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("quantity", sorted(INSTRUMENTS))
def test_each_quantity_is_defined_in_its_module(quantity):
    module, names = INSTRUMENTS[quantity]
    assert module in TREES, f"{quantity}: course_lib/{module} does not exist (update INSTRUMENTS)"
    defined = {
        target.id if isinstance(target, ast.Name) else getattr(target, "name", None)
        for node in TREES[module].body
        for target in (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else [node]
        )
    }
    missing = [name for name in names if name not in defined]
    assert not missing, f"{quantity}: course_lib/{module} no longer defines {missing}"


@pytest.mark.parametrize("quantity", sorted(INSTRUMENTS))
def test_no_other_module_defines_the_same_names(quantity):
    module, names = INSTRUMENTS[quantity]
    again = [
        f"course_lib/{path}:{node.lineno} {node.name}"
        for path, tree in TREES.items()
        if path != module
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names
    ]
    assert not again, (
        f"{quantity} is defined in course_lib/{module}; defined again at {again}: call it instead"
    )


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.quantity)
def test_no_second_implementation(rule):
    found = [
        f"course_lib/{path}:{line}"
        for path, tree in TREES.items()
        if path not in rule.owners
        for line in rule.find(tree)
    ]
    assert not found, (
        f"{rule.quantity} is defined in course_lib/{' or '.join(rule.owners)}; found a second "
        f"implementation at {found}: call the one definition instead"
    )


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.quantity)
def test_each_rule_finds_a_duplicate(rule):
    assert list(rule.find(_code(rule.duplicate))), f"the rule for {rule.quantity} no longer sees a duplicate"
