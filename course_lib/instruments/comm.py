"""Collectives one rank hands to the network, counted by kind: calls, payload bytes, dtypes; defined once.

``CollectiveLog`` + ``counting_collectives()``: every ``torch.distributed`` all-reduce, all-gather,
reduce-scatter and broadcast called through the ``torch.distributed`` module inside the block is
recorded (DDP's Python comm hooks, ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``). The payload
is the full, unsharded tensor: the all-reduced tensor, the all-gather's output, the reduce-scatter's
input, the broadcast tensor. ``ring_bytes`` turns a payload into what each rank sends in a ring
algorithm. DDP's built-in C++ all-reduce bypasses Python: register
a Python comm hook (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``) to
count it. Lessons 03 and 05 (``apparatus.mixed_precision``, ``apparatus.local_sgd_counting``) and 06b (``apparatus.sharding``)
count with this one counter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.instruments.memory import tensor_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "broadcast")
# torch.distributed function -> (kind, the argument that holds the full tensor)
_FUNCTIONS = {
    "all_reduce": ("all-reduce", "tensor"),
    "all_gather_into_tensor": ("all-gather", "output_tensor"),
    "all_gather_single": ("all-gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "reduce_scatter_single": ("reduce-scatter", "input"),
    "broadcast": ("broadcast", "tensor"),
}


@dataclass
class CollectiveLog:
    """Calls, payload bytes and the payloads' dtypes per kind of collective that one rank made."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    dtypes: dict[str, set[str]] = field(default_factory=lambda: {kind: set() for kind in KINDS})

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        """Count one collective of ``kind`` on ``tensor`` (elements x bytes per element)."""
        self.calls[kind] += 1
        self.bytes[kind] += tensor_bytes([tensor])
        self.dtypes[kind].add(str(tensor.dtype).removeprefix("torch."))

    def ring_bytes(self, world_size: int) -> int:
        """Bytes this rank sends in ring algorithms for all the recorded collectives."""
        return sum(ring_bytes(kind, self.bytes[kind], world_size) for kind in KINDS)


def ring_bytes(kind: str, payload: int, world_size: int) -> int:
    """Bytes each rank sends for one collective of ``kind`` on ``payload`` bytes, in a ring of ``world_size``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    factor = 2 if kind == "all-reduce" else 1  # a ring all-reduce is a reduce-scatter plus an all-gather
    # each rank sends (N - 1) of N chunks per phase
    return round(factor * payload * (world_size - 1) / world_size)


_ACTIVE: list[CollectiveLog] = []
_DEPTH = [0]  # one torch.distributed function may call another: count the outer call only


def _counted(name: str, real):
    kind, argument = _FUNCTIONS[name]
    signature = inspect.signature(real)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if _ACTIVE and _DEPTH[0] == 0:
            # bind: positional or keyword
            _ACTIVE[-1].record(kind, signature.bind(*args, **kwargs).arguments[argument])
        _DEPTH[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    return wrapper


@contextmanager
def counting_collectives(log: CollectiveLog | None = None) -> Iterator[CollectiveLog]:
    """Record every collective called through ``torch.distributed`` inside the block into ``log``.

    Blocks nest: the innermost one open gets each call, counted once (a collective that calls another
    counts as the outer one only). Leaving the block restores the functions it found.
    """
    log = CollectiveLog() if log is None else log
    # hasattr: all_gather_single and reduce_scatter_single are recent additions to torch
    saved = {name: getattr(dist, name) for name in _FUNCTIONS if hasattr(dist, name)}
    for name, real in saved.items():
        # on the module: seen by callers that look dist.<name> up at call time, not by earlier `from` imports
        setattr(dist, name, _counted(name, real))
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.pop()
        for name, real in saved.items():
            setattr(dist, name, real)
