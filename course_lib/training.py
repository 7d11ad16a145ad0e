"""The course's one training loop, with the efficiency techniques as switches.

Read ``train`` top to bottom: it is the loop from the slides (forward, loss, backward, step),
plus the lines each technique adds, each marked with a ``# [technique]`` comment:

* ``# [amp]``        mixed precision: ``torch.amp.autocast`` for fp16/bf16, a ``GradScaler`` for fp16 only
* ``# [accum]``      gradient accumulation over ``grad_accum_steps`` micro-batches
* ``# [clip]``       gradient clipping (after ``scaler.unscale_``)
* ``# [accelerate]`` the same loop driven by an ``Accelerator`` (device placement, DDP, autocast)
* ``# [ddp]``        gradient sync skipped on non-final micro-steps under DistributedDataParallel
* ``# [resume]``     continue a checkpointed run from optimizer step ``start_step``; ``on_step`` hook
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any

import torch
from tqdm.auto import tqdm

from course_lib.devices import (
    autocast_dtype,
    check_precision,
    get_device,
    seed_everything,
    synchronize,
    to_device,
)


@dataclass
class TrainConfig:
    """Settings of one training run (log it with ``dataclasses.asdict``)."""

    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: run all epochs
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    precision: str = "no"  # "no" | "fp16" | "bf16"
    grad_accum_steps: int = 1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str | None = None  # None: auto (cuda, mps, cpu); ignored with an Accelerator
    progress: bool = True
    eval_every_epoch: bool = True

    def __post_init__(self) -> None:
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}.")
        if self.epochs < 1 and not self.max_steps:
            raise ValueError("Set epochs >= 1 or max_steps >= 1: there is nothing to train.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")


@dataclass
class History:
    """What a run measured: per-step loss, time and tokens, plus evaluations."""

    config: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds per optimizer step
    step_tokens: list[int] = field(default_factory=list)  # padded tokens per optimizer step
    evals: list[dict[str, float]] = field(default_factory=list)
    scaler_scales: list[float] = field(default_factory=list)
    skipped_steps: int = 0  # fp16 steps the GradScaler skipped (inf/nan gradients)

    def tokens_per_s(self, skip: int = 1) -> float:
        """Median tokens per second over optimizer steps, ignoring the first ``skip`` (warm-up)."""
        pairs = list(zip(self.step_tokens, self.step_times))[skip:] or list(
            zip(self.step_tokens, self.step_times)
        )
        return statistics.median(tok / t for tok, t in pairs) if pairs else float("nan")

    def median_step_time(self, skip: int = 1) -> float:
        """Median seconds per optimizer step, ignoring the first ``skip`` (warm-up)."""
        times = self.step_times[skip:] or self.step_times
        return statistics.median(times) if times else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def accuracy_f1(preds: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Accuracy and binary F1 (positive class 1), computed locally: no ``evaluate.load``."""
    preds, labels = preds.long().flatten(), labels.long().flatten()
    if preds.shape != labels.shape:
        raise ValueError(f"preds {tuple(preds.shape)} and labels {tuple(labels.shape)} differ in shape.")
    if labels.numel() == 0:
        raise ValueError("No predictions to score: the evaluation set is empty.")
    tp = ((preds == 1) & (labels == 1)).sum().item()
    fp = ((preds == 1) & (labels == 0)).sum().item()
    fn = ((preds == 0) & (labels == 1)).sum().item()
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"accuracy": (preds == labels).float().mean().item(), "f1": f1}


def _autocast(device: torch.device, precision: str):
    """``torch.amp.autocast`` for fp16/bf16 on ``device``; a no-op context for fp32."""
    if precision == "no":
        return nullcontext()
    return torch.amp.autocast(device_type=device.type, dtype=autocast_dtype(precision))


@torch.no_grad()
def evaluate(model, dataloader, precision: str = "no", accelerator=None, device=None) -> dict[str, float]:
    """Mean loss, accuracy and F1 of ``model`` on ``dataloader`` (all processes' rows gathered)."""
    was_training = model.training
    model.eval()
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    precision = check_precision(precision, device) if accelerator is None else "no"
    all_preds, all_labels, losses = [], [], []
    for batch in dataloader:
        if accelerator is None:
            batch = to_device(batch, device)
        with _autocast(device, precision):
            out = model(**batch)
        preds, labels = out.logits.argmax(-1), batch["labels"]
        if accelerator is not None:
            preds, labels = accelerator.gather_for_metrics((preds, labels))
        all_preds.append(preds.cpu())
        all_labels.append(labels.cpu())
        losses.append(out.loss.float().item())
    if was_training:
        model.train()
    metrics = accuracy_f1(torch.cat(all_preds), torch.cat(all_labels))
    metrics["loss"] = sum(losses) / len(losses)
    return metrics


def fused_adamw_supported(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch has a fused AdamW kernel for all of ``params`` (floating point, on such a device)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a private helper: fall back to the devices known to have the kernel
        devices = {"cpu", "cuda"}
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and LayerNorm weights.

    ``fused=None`` (default) uses torch's fused AdamW kernel where there is one, as Trainer's default
    ``adamw_torch_fused`` does: one kernel for all parameters instead of a loop with temporaries
    (docs/benchmark.md measures the difference). The update is the same AdamW.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    if fused is None:
        fused = fused_adamw_supported(decay + no_decay)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def make_scheduler(optimizer, total_steps: int, warmup_ratio: float, start_step: int = 0):
    """Linear warm-up, then linear decay to zero; ``start_step`` continues a resumed run's schedule."""
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        step += start_step
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(
    model: torch.nn.Module,
    train_dataloader,
    config: TrainConfig | None = None,
    eval_dataloader=None,
    accelerator=None,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> History:
    """Fine-tune ``model`` on ``train_dataloader`` per ``config``; return the measured ``History``.

    Without ``accelerator`` the loop moves model and batches to ``config.device`` itself. With an
    ``Accelerator`` it calls ``accelerator.prepare`` on the model, optimizer and dataloaders (pass
    them unprepared) and the precision comes from the Accelerator.

    Resuming: load the model and optimizer state (and the RNG state) first, then pass
    ``start_step``: the learning-rate schedule and the data continue from that optimizer step.
    ``on_step(step)`` runs after every optimizer step (e.g. to save a checkpoint).
    """
    cfg = config or TrainConfig()
    if start_step == 0:
        seed_everything(cfg.seed)  # a resumed run keeps the RNG state its caller restored [resume]
    if len(train_dataloader) == 0:
        raise ValueError("The training DataLoader is empty: there is nothing to train on.")
    optimizer = optimizer or make_optimizer(model, cfg.lr, cfg.weight_decay)
    if accelerator is not None:  # [accelerate]
        device, precision = accelerator.device, accelerator.mixed_precision
        # The scheduler is not prepared: Accelerate would step it once per process per step.
        model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
        if eval_dataloader is not None:
            eval_dataloader = accelerator.prepare(eval_dataloader)
        scaler = None  # the Accelerator owns the GradScaler
        is_main = accelerator.is_main_process
    else:
        device = get_device(cfg.device)
        precision = check_precision(cfg.precision, device)
        model.to(device)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")  # [amp]
        is_main = True
    # Counted after prepare: under N processes each one sees 1/N of the batches.
    steps_per_epoch = math.ceil(len(train_dataloader) / cfg.grad_accum_steps)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    epochs = math.ceil(total_steps / steps_per_epoch)
    scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio, start_step)  # [resume]

    history = History(config={**asdict(cfg), "precision": precision, "device": str(device)})
    model.train()
    step = start_step
    first_epoch, skip = divmod(start_step, steps_per_epoch)  # [resume] where the checkpoint left off
    bar = tqdm(
        initial=start_step,
        total=total_steps,
        desc=f"train ({precision})",
        disable=not (cfg.progress and is_main),
    )
    for epoch in range(first_epoch, epochs):
        if hasattr(getattr(train_dataloader, "sampler", None), "set_epoch"):
            train_dataloader.sampler.set_epoch(epoch)  # [ddp] a new shuffle each epoch
        synchronize(device)
        t0, tokens, micro = time.perf_counter(), 0, 0
        done = skip * cfg.grad_accum_steps if epoch == first_epoch else 0  # [resume] batches trained on
        for i, batch in islice(enumerate(train_dataloader), done, None):
            last_micro = (micro + 1) % cfg.grad_accum_steps == 0 or i + 1 == len(train_dataloader)
            if accelerator is None:
                batch = to_device(batch, device)
            tokens += batch["input_ids"].numel()
            sync_ctx = nullcontext()
            if not last_micro and hasattr(model, "no_sync"):  # [ddp] no all-reduce mid-accumulation
                sync_ctx = model.no_sync()
            with sync_ctx:
                if accelerator is not None:
                    loss = model(**batch).loss / cfg.grad_accum_steps  # [accelerate] autocast inside
                    accelerator.backward(loss)
                else:
                    with _autocast(device, precision):  # [amp]
                        loss = model(**batch).loss / cfg.grad_accum_steps  # [accum]
                    scaler.scale(loss).backward()  # [amp] scaled loss: small fp16 grads survive
            micro += 1
            if not last_micro:
                continue
            if cfg.max_grad_norm:  # [clip]
                if accelerator is not None:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                else:
                    scaler.unscale_(optimizer)  # [amp] true gradients before clipping
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if scaler is not None:
                scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
                scaler.step(optimizer)  # [amp] skipped if gradients hold inf/nan
                scaler.update()
                if scaler.is_enabled():
                    history.scaler_scales.append(scaler.get_scale())
                    history.skipped_steps += int(scaler.get_scale() < scale_before)
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            t1 = time.perf_counter()
            history.losses.append(loss.item() * cfg.grad_accum_steps)
            history.step_times.append(t1 - t0)
            history.step_tokens.append(tokens)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{history.losses[-1]:.3f}")
            t0, tokens, micro = time.perf_counter(), 0, 0
            if on_step is not None:
                on_step(step)  # [resume] e.g. save a checkpoint here
            if step >= total_steps:
                break
        if eval_dataloader is not None and cfg.eval_every_epoch:
            history.evals.append({"step": step, **evaluate(model, eval_dataloader, precision, accelerator)})
        if step >= total_steps:
            break
    bar.close()
    if not all(math.isfinite(x) for x in history.losses):
        warnings.warn(
            "Some training losses were not finite: lower lr or use bf16/loss scaling.", stacklevel=2
        )
    return history


def fresh_accelerator(**kwargs):
    """A new ``Accelerator(**kwargs)`` even if one already exists in this process.

    ``Accelerator`` state is a process-wide singleton: a second one with another
    ``mixed_precision`` raises. This resets the shared state first (safe in a notebook with one
    process; do not call it inside a running distributed job). It warns when fp16 is asked for on
    a CPU, where Accelerate silently trains in fp32.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(**kwargs)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn(
            "Accelerator(mixed_precision='fp16') on a CPU does nothing: no autocast, no GradScaler, "
            "training runs in fp32. Use mixed_precision='bf16' on a CPU.",
            stacklevel=2,
        )
    return accelerator


def amp_is_active(accelerator) -> bool:
    """Whether an ``Accelerator`` really runs autocast (False for fp16 on CPU, see PITFALLS)."""
    return bool(getattr(accelerator, "native_amp", False)) and accelerator.mixed_precision != "no"
