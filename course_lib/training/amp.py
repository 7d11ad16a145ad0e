"""[amp] Mixed precision with ``torch.amp``: autocast for fp16/bf16, a ``GradScaler`` for fp16 only.

``TorchAmp`` is what the loop runs on without an ``Accelerator``: it also puts the model and each
batch on the device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from course_lib.devices import to_device
from course_lib.mixed_precision import autocast_dtype
from course_lib.training.fsdp import is_sharded


class TorchAmp:
    """The plain-PyTorch ``Backend``: device placement, autocast and loss scaling, as the slides write them."""

    is_main_process = True

    def __init__(self, device: torch.device, precision: str) -> None:
        self.device, self.precision = device, precision
        # bf16 has fp32's exponent range, so it needs no loss scaling; fp16 underflows without it
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def prepare(self, model, optimizer, train_dataloader, eval_dataloader):
        if not is_sharded(model):  # FSDP's shards stay where fully_shard put them  # [fsdp]
            model.to(self.device)
        return model, optimizer, train_dataloader, eval_dataloader

    def to_device(self, batch):
        return to_device(batch, self.device)

    def autocast(self) -> AbstractContextManager:
        if self.precision == "no":
            return nullcontext()
        return torch.amp.autocast(device_type=self.device.type, dtype=autocast_dtype(self.precision))

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()  # scaled loss: small fp16 gradients survive

    def unscale(self, optimizer) -> None:
        self.scaler.unscale_(optimizer)  # the true gradients again (before clipping)

    def step(self, optimizer, history) -> None:
        """``optimizer.step()`` through the scaler (skipped on inf/nan), recorded in ``history``."""
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.is_enabled():
            history.scaler_scales.append(self.scaler.get_scale())
            # update() halves the scale exactly when step() skipped the update (inf/nan gradients)
            history.skipped_steps += int(self.scaler.get_scale() < scale_before)

    def eval_args(self) -> dict:
        return {"precision": self.precision}
