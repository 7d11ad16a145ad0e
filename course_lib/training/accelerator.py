"""[accelerator] The same loop driven by an ``Accelerator``: placement, DDP, autocast, loss scaling.

``prepare`` wraps the model (DDP across processes, autocast in its forward), the optimizer (steps
through the GradScaler for fp16 on a GPU) and the DataLoaders (each process gets its shard, batches
arrive on the device). ``accelerator.backward`` scales the loss when a scaler is in use.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext

from course_lib.training.fsdp import accelerator_shards, is_sharded


class AcceleratorSteps:
    """The Accelerate ``Backend``: the loop's device, precision, backward and step, delegated to an ``Accelerator``."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.device, self.precision = accelerator.device, accelerator.mixed_precision
        self.is_main_process = accelerator.is_main_process

    def prepare(self, model, optimizer, train_dataloader, eval_dataloader):
        # The scheduler is not prepared: Accelerate would step it once per process per step.
        if is_sharded(model) and not accelerator_shards(self.accelerator):  # [fsdp] sharded by the loop
            # evaluation_mode: autocast only; Accelerate would wrap the sharded model in DDP on CPUs.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            optimizer, train_dataloader = self.accelerator.prepare(optimizer, train_dataloader)
        else:
            model, optimizer, train_dataloader = self.accelerator.prepare(model, optimizer, train_dataloader)
        if eval_dataloader is not None:
            eval_dataloader = self.accelerator.prepare(eval_dataloader)
        return model, optimizer, train_dataloader, eval_dataloader

    def to_device(self, batch):
        return batch  # a prepared DataLoader already delivers batches on the device

    def autocast(self) -> AbstractContextManager:
        return nullcontext()  # the prepared model autocasts inside its forward

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def unscale(self, optimizer) -> None:
        self.accelerator.unscale_gradients(optimizer)

    def step(self, optimizer, history) -> None:
        """``optimizer.step()`` through the Accelerator's GradScaler, a skipped fp16 step recorded."""
        optimizer.step()  # a prepared optimizer runs scaler.step + scaler.update itself
        scaler = self.accelerator.scaler  # None unless fp16 on a GPU
        if scaler is not None and scaler.is_enabled():
            history.scaler_scales.append(scaler.get_scale())
            history.skipped_steps += int(optimizer.step_was_skipped)  # inf/nan gradients: no update

    def eval_args(self) -> dict:
        return {"accelerator": self.accelerator}


def reset_accelerate_state() -> None:
    """Forget the process-wide ``Accelerator`` state, so the next one (or Trainer's) starts fresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # True: also the PartialState (device, process group info)
    GradientState._reset_state()


def fresh_accelerator(**kwargs):
    """A new ``Accelerator(**kwargs)`` even if one already exists in this process.

    ``Accelerator`` state is a process-wide singleton: a second one with another
    ``mixed_precision`` raises. This resets the shared state first (safe in a notebook with one
    process; do not call it inside a running distributed job). It warns when fp16 is asked for on
    a CPU, where Accelerate silently trains in fp32.
    """
    from accelerate import Accelerator

    reset_accelerate_state()
    accelerator = Accelerator(**kwargs)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn(
            "Accelerator(mixed_precision='fp16') on a CPU does nothing: no autocast, no GradScaler, "
            "training runs in fp32. Use mixed_precision='bf16' on a CPU.",
            stacklevel=2,
        )
    return accelerator


def amp_is_active(accelerator) -> bool:
    """Whether an ``Accelerator`` really runs autocast (False for fp16 on a CPU: Accelerate ignores it)."""
    return bool(getattr(accelerator, "native_amp", False)) and accelerator.mixed_precision != "no"
