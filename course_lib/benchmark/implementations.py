"""The four implementations of the same training run: the slides' loop, Accelerator, Trainer, the course loop."""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, Dataset

from course_lib import training
from course_lib.devices import (
    seed_everything,
)
from course_lib.training import slides
from course_lib.training.accelerator import reset_accelerate_state


@dataclass
class RunSpec:
    """One training run: ``steps`` optimizer steps of ``batch_size`` rows in ``precision``."""

    precision: str
    device: torch.device
    steps: int
    batch_size: int
    lr: float = 5e-4
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 0


@dataclass
class RunOutput:
    """What one run reports: per-step losses, whether autocast really ran, the optimizer used."""

    losses: list[float]
    amp_active: bool
    optimizer: str
    step_times: list[float] = field(default_factory=list)  # filled by the StepClock


def _loader(dataset: Dataset, spec: RunSpec) -> DataLoader:
    if len(dataset) < spec.steps * spec.batch_size:
        raise ValueError(
            f"The dataset has {len(dataset)} rows; {spec.steps} steps need {spec.steps * spec.batch_size}."
        )
    # unshuffled, last partial batch dropped: the batches Trainer's sequential sampler makes too
    return DataLoader(dataset, batch_size=spec.batch_size, shuffle=False, drop_last=True)


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap accelerate's AcceleratedOptimizer
    d = optimizer.defaults
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default"
    return f"{type(optimizer).__name__}({impl})"


def _slides_optimizer(model: torch.nn.Module, spec: RunSpec):
    """AdamW and a linear decay as the slides build them (``torch.optim.AdamW``'s defaults)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=spec.steps)


def train_slides_pytorch(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """The slides' hand-written loop (``course_lib.training.slides.train_pytorch``)."""
    seed_everything(spec.seed)
    model.to(spec.device)
    optimizer, scheduler = _slides_optimizer(model, spec)
    max_norm = spec.max_grad_norm or math.inf  # None: clip at inf, so the norm is still computed
    losses, _ = slides.train_pytorch(
        model, _loader(dataset, spec), optimizer, scheduler, spec.precision, max_norm
    )
    return RunOutput(losses, spec.precision != "no", _optimizer_name(optimizer))


def train_slides_accelerate(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """The slides' loop through ``Accelerator(mixed_precision=...)`` (``slides.train_accelerate``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does nothing.*")  # fp16 on CPU: reported as amp_active
        accelerator = training.fresh_accelerator(
            mixed_precision=spec.precision, cpu=spec.device.type == "cpu"
        )
    seed_everything(spec.seed)
    optimizer, scheduler = _slides_optimizer(model, spec)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(dataset, spec), scheduler
    )
    max_norm = spec.max_grad_norm or math.inf
    losses = slides.train_accelerate(accelerator, model, loader, optimizer, scheduler, max_norm)
    return RunOutput(losses, training.amp_is_active(accelerator), _optimizer_name(optimizer))


def train_trainer(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """Hugging Face ``Trainer`` (current argument names), same data order, its default optimizer."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, default_data_collator

    reset_accelerate_state()  # Trainer builds its own Accelerator: forget the one the previous run left
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=spec.steps,
            per_device_train_batch_size=spec.batch_size,
            learning_rate=spec.lr,
            weight_decay=spec.weight_decay,
            lr_scheduler_type="linear",
            warmup_steps=0,
            max_grad_norm=spec.max_grad_norm or 0.0,  # 0: Trainer skips clipping (and the norm)
            fp16=spec.precision == "fp16",
            bf16=spec.precision == "bf16",
            use_cpu=spec.device.type == "cpu",
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="steps",
            logging_steps=1,  # a loss every step, as the other loops record
            report_to="none",
            disable_tqdm=True,
            seed=spec.seed,
            train_sampling_strategy="sequential",  # the same batches in the same order as the loops
            dataloader_drop_last=True,
            dataloader_pin_memory=spec.device.type == "cuda",
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=default_data_collator,
            processing_class=getattr(dataset, "tokenizer", None),
        )
        trainer.remove_callback(PrinterCallback)  # it would print every step's log line
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return RunOutput(losses, training.amp_is_active(trainer.accelerator), _optimizer_name(trainer.optimizer))


def train_course(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """The course's loop, ``course_lib.training.train``, with the same settings."""
    config = training.TrainConfig(
        max_steps=spec.steps,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        warmup_ratio=0.0,
        precision=spec.precision,
        max_grad_norm=spec.max_grad_norm,
        seed=spec.seed,
        device=str(spec.device),
        progress=False,
        eval_every_epoch=False,
    )
    names: list[str] = []  # which optimizer the loop built, seen through a global step hook
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: names.append(_optimizer_name(optimizer))
    )
    try:
        history = training.train(model, _loader(dataset, spec), config)
    finally:
        handle.remove()
    return RunOutput(list(history.losses), spec.precision != "no", names[-1] if names else "unknown")


TRAINERS: dict[str, Callable[[torch.nn.Module, Dataset, RunSpec], RunOutput]] = {
    "pytorch": train_slides_pytorch,
    "accelerate": train_slides_accelerate,
    "trainer": train_trainer,
    "course": train_course,
}
