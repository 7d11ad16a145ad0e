"""[ddp] DistributedDataParallel details: no all-reduce mid-accumulation, a new shuffle each epoch.

DDP all-reduces gradients during every backward. Inside an accumulation window only the last
micro-batch's backward needs it: ``model.no_sync()`` skips the others (k-1 all-reduces saved per step).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext


def sync_gradients(model, update: bool) -> AbstractContextManager:
    """``model.no_sync()`` on a micro-batch that does not end the window (DDP models only)."""
    if not update and hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


def set_epoch(dataloader, epoch: int) -> None:
    """Tell a distributed sampler the epoch, so each one shuffles differently."""
    sampler = getattr(dataloader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
