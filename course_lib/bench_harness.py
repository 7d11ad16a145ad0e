"""The benchmark behind ``python -m course_lib.bench`` (how to read and reproduce it: docs/benchmark.md).

One run trains the same model, on the same fixed-shape batches, from the same initial weights and
seed, with four implementations of one fine-tuning step (forward, loss, backward, gradient
clipping, AdamW, linear learning-rate decay):

* ``pytorch``     the slides' hand-written loop: ``torch.amp.autocast`` + ``GradScaler`` (fp16 only)
* ``accelerate``  the same loop through ``Accelerator(mixed_precision=...)``
* ``trainer``     Hugging Face ``Trainer`` with ``TrainingArguments(fp16=/bf16=)``, its defaults otherwise
* ``course``      the course's own loop, ``course_lib.training.train``

Measuring rules: the runs are interleaved (round-robin over precisions and implementations, the
order rotated every round, so drift of a shared machine hits all alike); every run starts with
untimed warm-up steps; the clock is one forward pre-hook on the model, the same instrument for all
four (a step is the synchronised time from the start of one forward pass to the start of the next,
so it includes data loading, the optimizer and each library's own bookkeeping); a row reports the
median over rounds of each round's median step time.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, Dataset

from course_lib import models, training
from course_lib.bench import cuda_peak_mb, matmul_gflops, model_flops_per_token, peak_rss_mb_subprocess
from course_lib.devices import (
    autocast_dtype,
    best_precision,
    cpu_name,
    describe_machine,
    format_machine,
    get_device,
    normalize_precision,
    seed_everything,
    synchronize,
)

IMPLEMENTATIONS = ("pytorch", "accelerate", "trainer", "course")
LABELS = {
    "pytorch": "PyTorch loop",
    "accelerate": "Accelerator",
    "trainer": "Trainer",
    "course": "course_lib.train",
}
# Shapes on top of the embedded checkpoint's config (vocabulary 1,200). None: the checkpoint itself.
MODEL_SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,
    "small": {"dim": 256, "n_layers": 4, "n_heads": 4, "hidden_dim": 1024, "max_position_embeddings": 512},
    "base": {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "max_position_embeddings": 512},
}
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"
PRECISION_LABELS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class BenchConfig:
    """What one benchmark run measures (logged with ``asdict`` into every JSON row)."""

    sizes: tuple[str, ...] = ("tiny", "small", "base")
    precisions: tuple[str, ...] | None = None  # None: what the device supports meaningfully
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    batch_size: int = 16
    seq_len: int = 128  # every batch is padded to exactly (batch_size, seq_len)
    warmup: int = 1  # untimed optimizer steps at the start of every run
    steps: int = 3  # timed optimizer steps per run
    rounds: int = 3  # interleaved repetitions of every (precision, implementation)
    lr: float = 5e-4
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str | None = None  # None: auto (cuda, mps, cpu)
    memory: bool = True  # on CPU: one fresh subprocess per row (slow); on CUDA: the allocator's peak
    memory_steps: int = 2  # optimizer steps the CPU memory subprocess trains

    def __post_init__(self) -> None:
        self.sizes = tuple(_check_choice(s, MODEL_SIZES, "model size", "--sizes") for s in self.sizes)
        self.implementations = tuple(
            _check_choice(i, IMPLEMENTATIONS, "implementation", "--implementations")
            for i in self.implementations
        )
        if self.precisions is not None:
            self.precisions = tuple(dict.fromkeys(normalize_precision(p) for p in self.precisions))
        for name in ("batch_size", "seq_len", "steps", "rounds", "memory_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}.")
        if not self.sizes or not self.implementations or self.precisions == ():
            raise ValueError("Nothing to measure: give at least one size, precision and implementation.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")

    @property
    def run_steps(self) -> int:
        """Optimizer steps per run: warm-up, timed, plus one whose forward start closes the last period."""
        return self.warmup + self.steps + 1


def quick_config(**overrides: Any) -> BenchConfig:
    """The smoke-test preset: tiny model, fp32 and bf16, a few steps, no subprocess memory on CPU."""
    device = get_device(overrides.get("device"))
    settings: dict[str, Any] = {
        "sizes": ("tiny",),
        "precisions": ("no", "bf16" if device.type != "mps" else "fp16"),
        "warmup": 1,
        "steps": 3,
        "rounds": 2,
        "lr": 1e-3,
        "memory": device.type == "cuda",
    }
    settings.update(overrides)
    return BenchConfig(**settings)


def _check_choice(value: str, choices, what: str, flag: str) -> str:
    value = str(value).strip().lower()
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}: use one or more of {', '.join(choices)} ({flag}).")
    return value


def default_precisions(device: torch.device) -> tuple[str, ...]:
    """Precisions worth measuring on ``device``: fp32, plus bf16 where native, plus fp16 on GPUs."""
    if device.type == "cuda":
        return ("no", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("no", "fp16")
    if device.type == "mps":
        return ("no", "fp16")
    return ("no", "bf16") if best_precision(device) == "bf16" else ("no",)


# ----------------------------------------------------------------------------------------------
# Model and data: the same for every implementation


def build_model(size: str, seed: int = 0, seq_len: int = 128) -> torch.nn.Module:
    """The fp32 classifier of ``size``: the embedded checkpoint (tiny) or a seeded random init."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    size = _check_choice(size, MODEL_SIZES, "model size", "--sizes")
    seed_everything(seed)
    if MODEL_SIZES[size] is None:
        model = models.load_model("embedded")
    else:
        config = AutoConfig.from_pretrained(str(models.EMBEDDED_MODEL_DIR), num_labels=2, **MODEL_SIZES[size])
        model = AutoModelForSequenceClassification.from_config(config)
    limit = model.config.max_position_embeddings
    if seq_len > limit:
        raise ValueError(
            f"seq_len {seq_len} is longer than the {size} model's {limit} positions: use --seq-len {limit} "
            "or less."
        )
    return model


def count_matmul_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters outside embedding tables (a lookup does no matmul): the N of 6N."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in embedding)


class FixedLengthDataset(Dataset):
    """Sentence pairs padded to one length: every batch is ``(batch_size, seq_len)``."""

    def __init__(self, encodings: dict[str, torch.Tensor], tokenizer=None):
        self.encodings, self.tokenizer = encodings, tokenizer

    def __len__(self) -> int:
        return len(self.encodings["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[i] for key, value in self.encodings.items()}


def fixed_length_dataset(rows: int, seq_len: int = 128, tokenizer=None) -> FixedLengthDataset:
    """The first ``rows`` training pairs of the embedded MRPC data, padded/truncated to ``seq_len``.

    Rows repeat from the start if more are asked for than the split holds.
    """
    from course_lib import data

    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}.")
    tokenizer = tokenizer or models.load_tokenizer("embedded")
    split = data.load_mrpc("embedded")["train"]
    index = [i % len(split) for i in range(rows)]
    picked = split.select(index)
    enc = tokenizer(
        list(picked["sentence1"]),
        list(picked["sentence2"]),
        truncation=True,
        max_length=seq_len,
        padding="max_length",
        return_tensors="pt",
    )
    encodings = {
        "input_ids": enc["input_ids"],  # (rows, seq_len)
        "attention_mask": enc["attention_mask"],  # (rows, seq_len)
        "labels": torch.tensor(list(picked["label"]), dtype=torch.long),  # (rows,)
    }
    return FixedLengthDataset(encodings, tokenizer)


# ----------------------------------------------------------------------------------------------
# The four implementations of the same training run


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
    return DataLoader(dataset, batch_size=spec.batch_size, shuffle=False, drop_last=True)


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap accelerate's AcceleratedOptimizer
    d = optimizer.defaults
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default"
    return f"{type(optimizer).__name__}({impl})"


def train_pytorch(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """The slides' hand-written loop: autocast, GradScaler for fp16 only, clipping, AdamW."""
    device = spec.device
    seed_everything(spec.seed)
    model.to(device).train()
    loader = _loader(dataset, spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=spec.steps)
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    amp = spec.precision != "no"
    losses = []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # (B, T) each, labels (B,)
        with torch.amp.autocast(device.type, dtype=autocast_dtype(spec.precision), enabled=amp):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        if spec.max_grad_norm:
            scaler.unscale_(optimizer)  # true gradients before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return RunOutput(losses, amp, _optimizer_name(optimizer))


def train_accelerate(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """The same loop through ``Accelerator(mixed_precision=...)``: it owns device, autocast, scaler."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does nothing.*")  # fp16 on CPU: reported as amp_active
        accelerator = training.fresh_accelerator(
            mixed_precision=spec.precision, cpu=spec.device.type == "cpu"
        )
    seed_everything(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=spec.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(dataset, spec), scheduler
    )
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        if spec.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return RunOutput(losses, training.amp_is_active(accelerator), _optimizer_name(optimizer))


def train_trainer(model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """Hugging Face ``Trainer`` (current argument names), same data order, its default optimizer."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, default_data_collator

    _reset_accelerate_state()  # Trainer builds its own Accelerator
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=spec.steps,
            per_device_train_batch_size=spec.batch_size,
            learning_rate=spec.lr,
            weight_decay=spec.weight_decay,
            lr_scheduler_type="linear",
            warmup_steps=0,
            max_grad_norm=spec.max_grad_norm or 0.0,
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
    "pytorch": train_pytorch,
    "accelerate": train_accelerate,
    "trainer": train_trainer,
    "course": train_course,
}


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class StepClock:
    """Synchronised timestamps at the start of every forward pass of ``model`` (one per step)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device, self.stamps = device, []
        self._handle = model.register_forward_pre_hook(self._tick)

    def _tick(self, module, args) -> None:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def periods(self) -> list[float]:
        """Seconds from each forward start to the next."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def remove(self) -> None:
        self._handle.remove()


def run_once(
    implementation: str,
    model: torch.nn.Module,
    dataset: Dataset,
    spec: RunSpec,
    measure_cuda_memory: bool = False,
) -> tuple[RunOutput, float | None]:
    """Train ``model`` with ``implementation`` per ``spec``; return its output and CUDA peak MiB.

    ``RunOutput.step_times`` holds every step's period (the first ones are warm-up). The CUDA peak
    is what training allocated on top of the model's weights (``None`` off CUDA).
    """
    fn = TRAINERS[_check_choice(implementation, IMPLEMENTATIONS, "implementation", "--implementations")]
    model.to(spec.device)
    clock = StepClock(model, spec.device)
    out: list[RunOutput] = []
    peak = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fp16 on a CPU.*")
            if measure_cuda_memory and spec.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                peak = cuda_peak_mb(lambda: out.append(fn(model, dataset, spec)), spec.device)
            else:
                out.append(fn(model, dataset, spec))
    finally:
        clock.remove()
    result = out[0]
    result.step_times = clock.periods()
    return result, peak


# ----------------------------------------------------------------------------------------------
# CPU peak memory: one fresh subprocess per row


def _release_free_heap() -> None:
    """Collect garbage and hand freed heap back to the OS, so the RSS baseline is honest (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_probe(
    implementation: str,
    size: str,
    precision: str,
    batch_size: int = 16,
    seq_len: int = 128,
    steps: int = 2,
    seed: int = 0,
    lr: float = 5e-4,
    weight_decay: float = 0.01,
    max_grad_norm: float | None = 1.0,
    device: str = "cpu",
) -> Callable[[], dict]:
    """Set-up for ``peak_rss_mb_subprocess``: model and data now, the training run in the callable."""
    import transformers  # noqa: F401  (imports count as set-up, not as training memory)
    import transformers.trainer  # noqa: F401

    model = build_model(size, seed, seq_len)
    dataset = fixed_length_dataset(batch_size * steps, seq_len)
    spec = RunSpec(
        normalize_precision(precision),
        get_device(device),
        steps,
        batch_size,
        lr,
        weight_decay,
        max_grad_norm,
        seed,
    )
    fn = TRAINERS[implementation]
    _release_free_heap()

    def work() -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(model, dataset, spec)
        return {"losses": out.losses}

    return work


def cpu_peak_mb(implementation: str, size: str, precision: str, cfg: BenchConfig) -> float:
    """Peak RSS (MiB) that training added over model + data, in a fresh subprocess (Linux)."""
    out = peak_rss_mb_subprocess(
        "course_lib.bench_harness:memory_probe",
        implementation=implementation,
        size=size,
        precision=precision,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        steps=cfg.memory_steps,
        seed=cfg.seed,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
    )
    return out["work_mb"]


# ----------------------------------------------------------------------------------------------
# The benchmark


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Measure every (size, precision, implementation) of ``cfg``, interleaved; return the rows."""
    device = get_device(cfg.device)
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(
            f"Accelerator and Trainer always take the first visible GPU: instead of --device {device}, run "
            f"with CUDA_VISIBLE_DEVICES={device.index} and --device cuda."
        )
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        raise RuntimeError(
            "More than one GPU is visible: Trainer would wrap the model in DataParallel and the rows "
            "would not compare like with like. Run with CUDA_VISIBLE_DEVICES=0."
        )
    precisions = cfg.precisions or default_precisions(device)
    machine = machine_summary(device)
    load_start = _load_average()
    peaks = matmul_peaks(precisions, device)
    for p, gflops in peaks.items():
        log(f"matmul peak {PRECISION_LABELS[p]:>4}: {gflops:,.1f} GFLOP/s")
    tokenizer = models.load_tokenizer("embedded")
    dataset = fixed_length_dataset(cfg.batch_size * cfg.run_steps, cfg.seq_len, tokenizer)
    rows: list[dict[str, Any]] = []
    for size in cfg.sizes:
        rows += _measure_size(size, cfg, device, precisions, dataset, peaks, log)
    load = [load_start, _load_average()]
    for row in rows:
        row["machine"] = machine
        row["load_average"] = load  # 1-minute load at start and end: other work on the machine skews times
    add_ratios(rows)
    return rows


def matmul_peaks(precisions: Sequence[str], device: torch.device) -> dict[str, float]:
    """Matmul GFLOP/s in each precision's dtype, and fp32 (the peak of rows whose autocast was off)."""
    max_n = 16384 if device.type == "cuda" else 2048  # big enough to saturate the device
    return {
        p: matmul_gflops(autocast_dtype(p), device, max_n=max_n)["gflops"]
        for p in dict.fromkeys([*precisions, "no"])
    }


def _measure_size(
    size: str,
    cfg: BenchConfig,
    device: torch.device,
    precisions: Sequence[str],
    dataset: Dataset,
    peaks: dict[str, float],
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The rows of one model size: ``cfg.rounds`` interleaved rounds, then memory, then the numbers."""
    template = build_model(size, cfg.seed, cfg.seq_len)
    n_total, n_matmul = models.count_parameters(template), count_matmul_parameters(template)
    log(f"\n== {size}: {n_total / 1e6:.1f} M parameters ({n_matmul / 1e6:.1f} M in matmuls) ==")
    for precision in precisions:  # a slow path (fp16 on most CPUs) can take hours: say so up front
        floor = model_flops_per_token(n_matmul) * cfg.batch_size * cfg.seq_len / (peaks[precision] * 1e9)
        if floor > 10:
            log(
                f"note: a {PRECISION_LABELS[precision]} step with autocast takes at least {floor:,.0f} s here "
                f"(matmul peak {peaks[precision]:,.1f} GFLOP/s); leave it out with --precisions or --sizes."
            )
    spec = RunSpec(
        "no", device, cfg.run_steps, cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.max_grad_norm, cfg.seed
    )
    medians: dict[tuple[str, str], list[float]] = {}  # per-round median step time of each row
    last: dict[tuple[str, str], RunOutput] = {}
    cuda_mem: dict[tuple[str, str], float] = {}
    for r in range(cfg.rounds):
        shift = r % len(cfg.implementations)  # rotate the order every round
        order = cfg.implementations[shift:] + cfg.implementations[:shift]
        for precision in precisions:
            for impl in order:
                key = (precision, impl)
                measure = cfg.memory and r == cfg.rounds - 1
                out, peak = run_once(
                    impl, copy.deepcopy(template), dataset, replace(spec, precision=precision), measure
                )
                medians.setdefault(key, []).append(
                    statistics.median(out.step_times[cfg.warmup : cfg.warmup + cfg.steps])
                )
                last[key] = out
                if peak is not None:
                    cuda_mem[key] = peak
                log(
                    f"round {r + 1}/{cfg.rounds}  {PRECISION_LABELS[precision]:>4}  {impl:<10}  "
                    f"{medians[key][-1] * 1e3:9.1f} ms/step  loss {out.losses[-1]:.4f}"
                )
                gc.collect()
    del template
    gc.collect()
    rows = []
    for precision in precisions:
        for impl in cfg.implementations:
            key = (precision, impl)
            out = last[key]
            mem, method = cuda_mem.get(key), "cuda_allocator" if key in cuda_mem else None
            if cfg.memory and device.type == "cpu":
                log(f"peak memory (fresh subprocess): {size} {PRECISION_LABELS[precision]} {impl} ...")
                mem, method = cpu_peak_mb(impl, size, precision, cfg), "rss_subprocess"
            step = statistics.median(medians[key])
            tokens_per_s = cfg.batch_size * cfg.seq_len / step
            flops = model_flops_per_token(n_matmul) * tokens_per_s
            peak_dtype = precision if out.amp_active else "no"  # fp16 on a CPU via Accelerate/Trainer: fp32
            rows.append(
                {
                    "implementation": impl,
                    "precision": precision,
                    "model_size": size,
                    "device": str(device),
                    "amp_active": out.amp_active,
                    "optimizer": out.optimizer,
                    "n_params": n_total,
                    "n_matmul_params": n_matmul,
                    "batch_size": cfg.batch_size,
                    "seq_len": cfg.seq_len,
                    "rounds": cfg.rounds,
                    "timed_steps_per_round": cfg.steps,
                    "step_time_s": step,
                    "step_time_rounds_s": medians[key],
                    "tokens_per_s": tokens_per_s,
                    "achieved_gflops": flops / 1e9,
                    "peak_gflops": peaks[peak_dtype],
                    "mfu": flops / (peaks[peak_dtype] * 1e9),
                    "peak_mem_mb": mem,
                    "peak_mem_method": method,
                    "first_loss": out.losses[0],
                    "final_loss": out.losses[-1],
                    "losses": out.losses,
                }
            )
    return rows


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``vs_pytorch`` (tokens/s over the plain loop's) and ``vs_fp32`` (over the same row in fp32)."""
    index = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    for r in rows:
        base = index.get((r["model_size"], r["precision"], "pytorch"))
        fp32 = index.get((r["model_size"], "no", r["implementation"]))
        r["vs_pytorch"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["vs_fp32"] = r["tokens_per_s"] / fp32["tokens_per_s"] if fp32 else None


def machine_summary(device: torch.device) -> str:
    """One line: the device's name, torch version and threads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        threads = torch.get_num_threads()
        name = f"{cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"
    return f"{device.type}: {name}; torch {torch.__version__}"


# ----------------------------------------------------------------------------------------------
# Reports: JSON, markdown, chart, README section, target checks

COLUMNS = (
    "size",
    "implementation",
    "precision",
    "autocast",
    "step (ms)",
    "tokens/s",
    "vs PyTorch",
    "vs fp32",
    "peak mem (MB)",
    "GFLOP/s",
    "MFU",
    "final loss",
)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:{spec}}{suffix}"
    )


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table, one line per (size, precision, implementation)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [
            r["model_size"],
            LABELS[r["implementation"]],
            PRECISION_LABELS[r["precision"]],
            "yes" if r["amp_active"] else "no",
            _fmt(r["step_time_s"] * 1e3, ",.1f"),
            _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["vs_pytorch"], ".2f", "x"),
            _fmt(r["vs_fp32"], ".2f", "x"),
            _fmt(r["peak_mem_mb"], ",.0f"),
            _fmt(r["achieved_gflops"], ",.1f"),
            _fmt(100 * r["mfu"], ".1f", "%"),
            _fmt(r["final_loss"], ".4f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def target_checks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The course's targets (issue 6), one line each: the measured ratio, the noise, met or not.

    * the course loop >= 0.98x the PyTorch loop's tokens/s, and faster than Trainer (every row);
    * bf16 >= 1.8x fp32 with the course loop at base size (on a CPU with fast bf16 matmuls);
    * mixed precision's peak memory below fp32's at base size.

    Timing lines carry the round-to-round spread of the two rows compared: a ratio closer to its
    target than that is noise, whatever the verdict says.
    """
    index = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    lines = []
    for (size, precision, impl), r in index.items():
        if impl != "course":
            continue
        label = f"{size} {PRECISION_LABELS[precision]}"
        base = index.get((size, precision, "pytorch"))
        if base:
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            lines.append(
                f"course loop vs PyTorch loop, {label}: {ratio:.3f}x{_noise(r, base)} "
                f"(target >= 0.98x: {_ok(ratio >= 0.98)})"
            )
        trainer = index.get((size, precision, "trainer"))
        if trainer:
            ratio = r["tokens_per_s"] / trainer["tokens_per_s"]
            fp32 = (
                " (Trainer ran in fp32: no autocast)"
                if trainer.get("amp_active") is False and precision != "no"
                else ""
            )
            lines.append(
                f"course loop vs Trainer, {label}: {ratio:.3f}x{_noise(r, trainer)} "
                f"(target > 1x: {_ok(ratio > 1)}){fp32}"
            )
        fp32_row = index.get((size, "no", impl))
        if precision == "bf16" and fp32_row:
            ratio = r["tokens_per_s"] / fp32_row["tokens_per_s"]
            target = f" (target >= 1.8x on a fast-bf16 CPU: {_ok(ratio >= 1.8)})" if size == "base" else ""
            lines.append(f"course loop bf16 over fp32, {size}: {ratio:.2f}x{_noise(r, fp32_row)}{target}")
    for (size, precision, impl), r in index.items():
        fp32_row = index.get((size, "no", impl))
        if size != "base" or precision == "no" or not fp32_row:
            continue
        if r.get("peak_mem_mb") is None or fp32_row.get("peak_mem_mb") is None:
            continue
        ok = r["peak_mem_mb"] < fp32_row["peak_mem_mb"]
        lines.append(
            f"peak memory {PRECISION_LABELS[precision]} vs fp32, {size}, {LABELS[impl]}: "
            f"{r['peak_mem_mb']:,.0f} vs {fp32_row['peak_mem_mb']:,.0f} MB (target: below: {_ok(ok)})"
        )
    return lines


def _noise(*rows: dict[str, Any]) -> str:
    """`` (spread ±x%)``: the larger round-to-round spread of the rows' step times; empty if unknown."""
    spreads = []
    for r in rows:
        times = r.get("step_time_rounds_s") or []
        if len(times) >= 2:
            spreads.append((max(times) - min(times)) / statistics.median(times))
    return f" (rounds spread {100 * max(spreads):.0f}%)" if spreads else ""


def _ok(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown_report(rows: Sequence[dict[str, Any]], cfg: BenchConfig, seconds: float | None = None) -> str:
    """Table plus the settings and machine it was measured with (what the README section holds)."""
    machine = rows[0]["machine"] if rows else machine_summary(get_device(cfg.device))
    took = f"; the whole run took {seconds / 60:.1f} min" if seconds is not None else ""
    methods = {r["peak_mem_method"] for r in rows} - {None}
    memory = {
        "cuda_allocator": "the CUDA allocator's peak",
        "rss_subprocess": "the peak RSS of a fresh process",
    }
    mem_note = (
        "Peak memory: what training added on top of the model's fp32 weights ("
        + ", ".join(memory[m] for m in sorted(methods))
        + "). "
        if methods
        else "Peak memory not measured. "
    )
    load = rows[0].get("load_average") if rows else None
    if load and None not in load:
        machine += f" (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {os.cpu_count()} cores)"
    header = (
        f"Measured on {machine}. Batches of {cfg.batch_size} x {cfg.seq_len} tokens (padded), "
        f"{cfg.rounds} interleaved rounds x {cfg.steps} timed steps after {cfg.warmup} warm-up step(s), "
        f"median step time{took}. {mem_note}MFU: 6N FLOPs per token over the measured matmul peak of "
        "the dtype the row computed in."
    )
    return f"{header}\n\n{markdown_table(rows)}\n"


def write_json(rows: Sequence[dict[str, Any]], path: str | Path, cfg: BenchConfig) -> None:
    """Write the rows (a JSON list), each carrying the run's settings."""
    settings = asdict(cfg)
    payload = [{**row, "config": settings} for row in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Bar chart of tokens/s: a panel per model size, implementations grouped, a bar per precision.

    Each bar is labelled with its ratio to the plain PyTorch loop in the same precision.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["model_size"] for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    index = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(6.0, 4.5 * len(sizes)), 4.2), squeeze=False)
    width = 0.8 / len(precisions)
    for ax, size in zip(axes[0], sizes):
        top = 0.0
        for j, precision in enumerate(precisions):
            xs, ys, labels = [], [], []
            for i, impl in enumerate(impls):
                r = index.get((size, precision, impl))
                if r:
                    xs.append(i + (j - (len(precisions) - 1) / 2) * width)
                    ys.append(r["tokens_per_s"])
                    labels.append(_fmt(r.get("vs_pytorch"), ".2f", "x"))
            bars = ax.bar(xs, ys, width, label=PRECISION_LABELS[precision])
            ax.bar_label(bars, labels, fontsize=7, padding=2)
            top = max([top, *ys])
        ax.set_ylim(0, top * 1.3)
        ax.set_xticks(range(len(impls)), [LABELS[i] for i in impls], rotation=20, ha="right")
        ax.set_title(f"{size} model", fontsize=10)
        ax.set_ylabel("tokens / s")
        ax.legend(title="precision", fontsize=8, title_fontsize=8, loc="upper right", ncols=len(precisions))
    machine = rows[0]["machine"] if rows else ""
    fig.suptitle(
        f"Training throughput, same model, data and shapes (labels: vs the PyTorch loop)\n{machine}",
        fontsize=8,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_readme_section(path: str | Path, markdown: str) -> None:
    """Replace what lies between the marker lines ``<!-- bench:start -->`` and ``<!-- bench:end -->``.

    Only markers alone on their line count (a marker quoted in prose or code is left alone).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the README to update, e.g. --readme README.md.")
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == README_START]
    ends = [i for i, line in enumerate(lines) if line.strip() == README_END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(
            f"{path} needs exactly one '{README_START}' line followed by one '{README_END}' line (found "
            f"{len(starts)} and {len(ends)}): add the two marker lines, each on its own line, where the "
            "benchmark table should go, then run again."
        )
    new = [*lines[: starts[0] + 1], markdown.strip() + "\n", *lines[ends[0] :]]
    path.write_text("".join(new))


# ----------------------------------------------------------------------------------------------
# Command line


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    """Command-line flags into a ``BenchConfig`` (``--quick`` sets a preset the other flags override)."""
    p = argparse.ArgumentParser(
        prog="python -m course_lib.bench",
        description="Training throughput of a PyTorch loop, Accelerator, Trainer and course_lib.train: "
        "same model, data, batch shapes and seed, interleaved runs.",
        epilog="What each column means and how it is measured: docs/benchmark.md.",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, fp32+bf16, few steps")
    p.add_argument("--sizes", type=_csv, help=f"comma-separated, from {', '.join(MODEL_SIZES)}")
    p.add_argument("--precisions", type=_csv, help="comma-separated from no (fp32), bf16, fp16")
    p.add_argument("--implementations", type=_csv, help=f"comma-separated, from {', '.join(IMPLEMENTATIONS)}")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, help="untimed optimizer steps at the start of every run")
    p.add_argument("--rounds", type=int, help="interleaved repetitions")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, mps")
    p.add_argument("--no-memory", action="store_true", help="skip peak memory (on CPU: a subprocess per row)")
    p.add_argument("--memory", action="store_true", help="measure peak memory even with --quick")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the markdown report")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG)")
    p.add_argument("--readme", metavar="PATH", help=f"put the table between {README_START} and {README_END}")
    args = p.parse_args(argv)
    overrides = {
        name: getattr(args, name)
        for name in (
            "sizes",
            "precisions",
            "implementations",
            "batch_size",
            "seq_len",
            "steps",
            "warmup",
            "rounds",
            "lr",
            "seed",
            "device",
        )
        if getattr(args, name) is not None
    }
    if args.no_memory:
        overrides["memory"] = False
    elif args.memory:
        overrides["memory"] = True
    cfg = quick_config(**overrides) if args.quick else BenchConfig(**overrides)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_args(argv)
        if args.readme and not Path(args.readme).is_file():
            raise FileNotFoundError(f"{args.readme} does not exist: pass the README to update.")
        print(format_machine(describe_machine()))
        print(f"\nconfig: {asdict(cfg)}\n")
        start = time.perf_counter()
        rows = run_benchmark(cfg)
        seconds = time.perf_counter() - start
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = markdown_report(rows, cfg, seconds)
    checks = target_checks(rows)
    print("\n" + report)
    if checks:
        print("Targets:\n" + "\n".join(f"- {line}" for line in checks))
    print(f"\nbenchmark took {seconds:.0f} s")
    if args.json:
        write_json(rows, args.json, cfg)
    if args.markdown:
        text = report + ("\nTargets:\n\n" + "\n".join(f"- {c}" for c in checks) + "\n" if checks else "")
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(rows, args.plot)
    if args.readme:
        write_readme_section(args.readme, report)
    return 0
