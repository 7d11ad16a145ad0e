"""Lesson 05's counters: what each way of keeping data-parallel replicas in step hands to the network.

* ``CommLog`` reads the all-reduce calls, bytes and dtypes one rank sent from ``instruments.comm``'s one
  counter; ``counting_all_reduce`` counts every ``torch.distributed.all_reduce`` made inside it (DDP's
  Python comm hooks, Accelerate's ``LocalSGD``); ``counting_hook`` wraps a DDP comm hook so that it
  counts (the lesson shows it line for line); ``comm_hook`` picks DDP's hook by name
  (``training.ddp.COMM_HOOKS``, whose "none" the tables call "fp32").
* arithmetic: ``comm_bytes`` (what a strategy should send), ``average_parameters`` (local SGD's
  averaging, for replicas held in one process).
* ``bf16_build_support``: the facts DDP's check for ``bf16_compress_hook`` reads, and its verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.instruments.comm import CollectiveLog, counting_collectives
from course_lib.training.ddp import COMM_HOOKS

# The comm hooks are the training loop's (training.ddp.COMM_HOOKS); its "none", DDP's own fp32 all-reduce,
# is labelled "fp32" here and run as the Python hook that does the same, so that it can be counted.
FP32 = "fp32"
HOOKS = tuple(FP32 if name == "none" else name for name in COMM_HOOKS)  # ("fp32", "fp16", "bf16")


@dataclass
class CommLog:
    """All-reduce calls, bytes and dtypes one rank handed to the network (``instruments.comm`` counts)."""

    collectives: CollectiveLog = field(default_factory=CollectiveLog)

    def record(self, tensor: torch.Tensor) -> None:
        """Count one all-reduce of ``tensor`` (its payload: elements x bytes per element)."""
        self.collectives.record("all-reduce", tensor)

    @property
    def calls(self) -> int:
        return self.collectives.calls["all-reduce"]

    @property
    def bytes(self) -> int:
        return self.collectives.bytes["all-reduce"]

    @property
    def dtypes(self) -> set[str]:
        return self.collectives.dtypes["all-reduce"]


@contextmanager
def counting_all_reduce(log: CommLog) -> Iterator[CommLog]:
    """Count into ``log`` every ``torch.distributed.all_reduce`` called inside (innermost counter wins).

    DDP's built-in all-reduce runs in C++ and is not seen; register a Python comm hook
    (``default_hooks.allreduce_hook``, which does the same) to count it.
    """
    with counting_collectives(log.collectives):
        yield log


def counting_hook(hook: Callable) -> Callable:
    """A DDP comm hook that runs ``hook`` and counts what it all-reduces into its state (a ``CommLog``).

    Register it with ``ddp_model.register_comm_hook(log, counting_hook(default_hooks.allreduce_hook))``.
    """

    def counted(log: CommLog, bucket):
        with counting_all_reduce(log):
            return hook(None, bucket)  # None: the default process group

    counted.__name__ = f"counting_{getattr(hook, '__name__', 'hook')}"
    return counted


def comm_hook(name: str) -> Callable:
    """DDP's comm hook for one of ``HOOKS``: ``"fp32"`` (``allreduce_hook``), ``"fp16"``/``"bf16"`` (compress).

    The names are ``training.ddp.COMM_HOOKS``'; its ``"none"`` (DDP's built-in all-reduce, in C++, where
    no counter sees it) is ``"fp32"`` here, run as the Python hook that does the same all-reduce.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name not in HOOKS:
        raise ValueError(f"Unknown hook {name!r}: use one of {', '.join(HOOKS)}.")
    if name == FP32:
        return default_hooks.allreduce_hook
    return getattr(default_hooks, f"{name}_compress_hook")  # fp16_compress_hook, bf16_compress_hook


def comm_bytes(num_params: int, bytes_per_elem: int, steps: int, sync_every: int = 1) -> int:
    """Bytes one rank hands to all-reduce in ``steps`` steps when it syncs all parameters every ``sync_every``."""
    if sync_every < 1 or steps < 0 or num_params < 0 or bytes_per_elem < 1:
        raise ValueError("Need num_params >= 0, bytes_per_elem >= 1, steps >= 0 and sync_every >= 1.")
    return num_params * bytes_per_elem * (steps // sync_every)


@torch.no_grad()
def average_parameters(models: Sequence[torch.nn.Module]) -> None:
    """Set every model's parameters to their mean over ``models`` (local SGD's averaging, in one process)."""
    for params in zip(*(m.parameters() for m in models)):
        mean = torch.stack([p.detach() for p in params]).mean(dim=0)
        for p in params:
            p.copy_(mean)


def bf16_build_support() -> dict:
    """The facts DDP's check for ``bf16_compress_hook`` reads, and its verdict (``accepts``).

    The same test as ``DistributedDataParallel._check_comm_hook`` (torch 2.13): a CUDA or ROCm build
    with NCCL 2.10+, or XPU with XCCL. The process group's backend is not part of it.
    """
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else None
    xccl = dist.is_available() and dist.is_xccl_available() and torch.xpu.is_available()
    cuda_and_nccl = (cuda is not None or hip is not None) and nccl and torch.cuda.nccl.version() >= (2, 10)
    return {
        "torch.version.cuda": cuda,
        "torch.version.hip": hip,
        "NCCL": nccl_version or "not built in",
        "XPU + XCCL": xccl,
        "accepts": bool(cuda_and_nccl or xccl),
    }
