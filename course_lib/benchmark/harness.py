"""The measuring harness behind ``python -m course_lib.cli.bench`` (how to read it: docs/benchmark.md).

One run trains the same model, on the same fixed-shape batches, from the same initial weights and
seed, with four implementations of one fine-tuning step (forward, loss, backward, gradient
clipping, AdamW, linear learning-rate decay):

* ``pytorch``     the slides' hand-written loop: ``torch.amp.autocast`` + ``GradScaler`` (fp16 only)
* ``accelerate``  the same loop through ``Accelerator(mixed_precision=...)``
* ``trainer``     Hugging Face ``Trainer`` with ``TrainingArguments(fp16=/bf16=)``, its defaults otherwise
* ``course``      the course's own loop, ``course_lib.training.train``

Measuring rules: the runs are interleaved, every run starts with untimed warm-up steps, one clock
times all four, and a row reports the median over rounds of each round's median step time.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from course_lib import models
from course_lib.benchmark.config import IMPLEMENTATIONS, BenchConfig, check_choice, default_precisions
from course_lib.benchmark.implementations import TRAINERS, RunOutput, RunSpec
from course_lib.benchmark.workloads import build_model, count_matmul_parameters, fixed_length_dataset
from course_lib.devices import (
    cpu_name,
    get_device,
)
from course_lib.instruments.memory import SavedTensors, optimizer_state_bytes, tensor_peak_mb
from course_lib.instruments.throughput import matmul_gflops, mfu, model_flops_per_token
from course_lib.instruments.timing import StepClock
from course_lib.mixed_precision import autocast_dtype, precision_label


def run_once(implementation: str, model: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> RunOutput:
    """Train ``model`` with ``implementation`` per ``spec``; ``step_times`` holds every step's period.

    The clock is a ``StepClock`` on the model (the first periods are warm-up).
    """
    fn = TRAINERS[check_choice(implementation, IMPLEMENTATIONS, "implementation", "--implementations")]
    model.to(spec.device)
    # one forward pre-hook, the same instrument for all four: a step is the synchronised time from one
    # forward's start to the next, so it includes data loading, the optimizer and each library's bookkeeping
    clock = StepClock(model, spec.device)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fp16 on a CPU.*")
            out = fn(model, dataset, spec)
    finally:
        clock.remove()
    out.step_times = clock.periods()
    return out


def peak_memory_mb(
    implementation: str, template: torch.nn.Module, dataset: Dataset, spec: RunSpec, steps: int
) -> float:
    """Peak tensor memory (MiB) of ``steps`` training steps above the model's weights (``TensorPeak``).

    A separate short run after the timed rounds: on a CPU the profiler that measures it slows the run.
    """
    model = copy.deepcopy(template).to(spec.device)  # the weights are allocated before the start
    rows = Subset(dataset, range(spec.batch_size * steps))
    gc.collect()
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tensor_peak_mb(
            lambda: TRAINERS[implementation](model, rows, replace(spec, steps=steps)), spec.device
        )


def state_breakdown(template: torch.nn.Module, dataset: Dataset, spec: RunSpec) -> dict[str, float]:
    """What one step keeps, in MiB, the same for every implementation: the activations autograd saves
    for backward (``SavedTensors``, under the row's autocast) and AdamW's state after the step."""
    model = copy.deepcopy(template).to(spec.device)
    rows = [dataset[i] for i in range(spec.batch_size)]
    batch = {k: torch.stack([r[k] for r in rows]).to(spec.device) for k in rows[0]}
    autocast = torch.autocast(
        spec.device.type, dtype=autocast_dtype(spec.precision), enabled=spec.precision != "no"
    )
    with SavedTensors() as saved, autocast:
        loss = model(**batch).loss
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    optimizer.step()
    return {
        "saved_for_backward_mb": saved.bytes / 2**20,
        "optimizer_state_mb": optimizer_state_bytes(optimizer) / 2**20,
    }


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
    load_start = load_average()
    peaks = matmul_peaks(precisions, device)
    for p, gflops in peaks.items():
        log(f"matmul peak {precision_label(p):>4}: {gflops:,.1f} GFLOP/s")
    tokenizer = models.load_tokenizer("embedded")
    dataset = fixed_length_dataset(cfg.batch_size * cfg.run_steps, cfg.seq_len, tokenizer)
    rows: list[dict[str, Any]] = []
    for size in cfg.sizes:
        rows += _measure_size(size, cfg, device, precisions, dataset, peaks, log)
    load = [load_start, load_average()]
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
        for p in dict.fromkeys([*precisions, "no"])  # fp32 too: the peak of rows whose autocast was off
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
    shape = {"n_layers": template.config.n_layers, "d_model": template.config.dim, "seq_len": cfg.seq_len}
    log(f"\n== {size}: {n_total / 1e6:.1f} M parameters ({n_matmul / 1e6:.1f} M in matmuls) ==")
    for precision in precisions:  # a slow path (fp16 on most CPUs) can take hours: say so up front
        floor = (
            model_flops_per_token(n_matmul, **shape) * cfg.batch_size * cfg.seq_len / (peaks[precision] * 1e9)
        )
        if floor > 10:
            log(
                f"note: a {precision_label(precision)} step with autocast takes at least {floor:,.0f} s here "
                f"(matmul peak {peaks[precision]:,.1f} GFLOP/s); leave it out with --precisions or --sizes."
            )
    spec = RunSpec(
        "no", device, cfg.run_steps, cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.max_grad_norm, cfg.seed
    )
    medians: dict[tuple[str, str], list[float]] = {}  # per-round median step time of each row
    last: dict[tuple[str, str], RunOutput] = {}
    for r in range(cfg.rounds):
        shift = r % len(cfg.implementations)  # rotated every round: a busy machine's drift hits all
        order = cfg.implementations[shift:] + cfg.implementations[:shift]
        for precision in precisions:
            for impl in order:
                key = (precision, impl)
                out = run_once(impl, copy.deepcopy(template), dataset, replace(spec, precision=precision))
                # the warm-up periods left out; the + 1 run step only closes the last timed period
                medians.setdefault(key, []).append(
                    statistics.median(out.step_times[cfg.warmup : cfg.warmup + cfg.steps])
                )
                last[key] = out
                log(
                    f"round {r + 1}/{cfg.rounds}  {precision_label(precision):>4}  {impl:<10}  "
                    f"{medians[key][-1] * 1e3:9.1f} ms/step  loss {out.losses[-1]:.4f}"
                )
                gc.collect()
    rows = []
    for precision in precisions:
        kept = state_breakdown(template, dataset, replace(spec, precision=precision))
        for impl in cfg.implementations:
            key = (precision, impl)
            out = last[key]
            mem = method = None
            if cfg.memory:
                mem = peak_memory_mb(
                    impl, template, dataset, replace(spec, precision=precision), cfg.memory_steps
                )
                method = "tensor_peak"
            step = statistics.median(medians[key])
            tokens_per_s = cfg.batch_size * cfg.seq_len / step
            flops_per_token = model_flops_per_token(n_matmul, **shape)
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
                    "n_layers": shape["n_layers"],
                    "d_model": shape["d_model"],
                    "batch_size": cfg.batch_size,
                    "seq_len": cfg.seq_len,
                    "rounds": cfg.rounds,
                    "timed_steps_per_round": cfg.steps,
                    "step_time_s": step,
                    "step_time_rounds_s": medians[key],
                    "tokens_per_s": tokens_per_s,
                    "achieved_gflops": flops_per_token * tokens_per_s / 1e9,
                    "peak_gflops": peaks[peak_dtype],
                    "mfu": mfu(tokens_per_s, flops_per_token, peaks[peak_dtype]),
                    "peak_mem_mb": mem,
                    "peak_mem_method": method,
                    **kept,
                    "first_loss": out.losses[0],
                    "final_loss": out.losses[-1],
                    "losses": out.losses,
                }
            )
    del template
    gc.collect()
    return rows


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): above the core count, other work shared the CPU."""
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
