"""[ddp] DistributedDataParallel details: no all-reduce mid-accumulation, a new shuffle each epoch,
and a communication hook that compresses the gradients DDP sends (half the bytes on the wire).

DDP all-reduces gradients during every backward; with accumulation that is k-1 all-reduces too many
per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

COMM_HOOKS = ("none", "fp16", "bf16")  # "none": DDP's built-in fp32 all-reduce


def register_comm_hook(model, name: str = "none") -> None:
    """Register DDP's ``fp16_compress_hook`` or ``bf16_compress_hook`` on a DDP ``model``.

    "none" keeps DDP's built-in fp32 all-reduce. A model that is not DDP-wrapped (one process) has
    nothing to communicate: the call does nothing.
    """
    if name not in COMM_HOOKS:
        raise ValueError(f"Unknown comm hook {name!r}: use one of {', '.join(COMM_HOOKS)}.")
    if name == "none" or not hasattr(model, "register_comm_hook"):
        return
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # DDP accepts bf16 only in a CUDA/ROCm build with NCCL 2.10+ (any backend); the course asks for NCCL
    if name == "bf16" and dist.get_backend() != "nccl":
        import torch

        raise ValueError(
            f"The course runs the bf16 compression hook on the NCCL backend (GPUs) only; this run uses "
            f"{dist.get_backend()}. PyTorch's DDP itself accepts bf16_compress_hook only in a build with CUDA "
            f"and NCCL 2.10+ (or XPU and XCCL), whatever the backend; this build: CUDA {torch.version.cuda}, "
            f"NCCL {'available' if dist.is_nccl_available() else 'not available'}. "
            "Use --comm-hook fp16 (any backend and build), or none."
        )
    hook = default_hooks.bf16_compress_hook if name == "bf16" else default_hooks.fp16_compress_hook
    # each gradient bucket cast to 16 bits before the all-reduce and back after it; state=None: default group
    model.register_comm_hook(state=None, hook=hook)


def sync_gradients(model, update: bool) -> AbstractContextManager:
    """No gradient communication on a micro-batch that does not end the window: DDP's ``no_sync()``,
    or FSDP2's ``set_requires_gradient_sync(False)`` (its unsharded gradients accumulate until the last)."""
    if not update and hasattr(model, "no_sync"):
        return model.no_sync()  # gradients accumulate locally; the window's last backward all-reduces
    if not update and hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)  # [fsdp] the reduce-scatter waits for the window's last backward
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def set_epoch(dataloader, epoch: int) -> None:
    """Tell the loader's (batch) sampler the epoch, so each epoch shuffles differently."""
    for sampler in (getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)):
        if hasattr(sampler, "set_epoch"):  # a DistributedSampler, or a length-grouped batch sampler
            sampler.set_epoch(epoch)
