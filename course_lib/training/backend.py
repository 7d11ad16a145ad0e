"""The loop's backend: what ``train`` asks of the object that places, autocasts, scales and steps.

Two backends implement ``Backend``: ``amp.TorchAmp`` (plain PyTorch: ``.to(device)``, ``torch.amp``,
a ``GradScaler``) and ``accelerator.AcceleratorSteps`` (the same calls delegated to an ``Accelerator``).
The loop picks one and then calls only these members, so it has no branch per backend; a test checks
both classes against the protocol, and the loop's (and ``clip.py``'s) calls against its members.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    """What the training loop calls on its backend (every member; nothing else is called)."""

    device: torch.device  # where batches and the model live
    precision: str  # "no" | "fp16" | "bf16": what the run really uses
    is_main_process: bool  # rank 0 (or the only process): the one that shows progress

    def prepare(self, model, optimizer, train_dataloader, eval_dataloader) -> tuple[Any, Any, Any, Any]:
        """Place (and wrap) the model, optimizer and dataloaders; return them in that order."""
        ...

    def to_device(self, batch):
        """The batch on ``device`` (a no-op where the dataloader already delivers it there)."""
        ...

    def autocast(self) -> AbstractContextManager:
        """The forward's mixed-precision context (a null context where the model autocasts itself)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        ...

    def unscale(self, optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping; ``clip.py`` calls it)."""
        ...

    def step(self, optimizer, history) -> None:
        """``optimizer.step()`` (skipped on inf/nan under fp16), the scaler's state recorded in ``history``."""
        ...

    def eval_args(self) -> dict:
        """Keyword arguments of ``metrics.evaluate`` for this backend."""
        ...
