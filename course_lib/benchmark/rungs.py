"""The rungs of the recipe ladder and one timed run of a stack of them (``python -m course_lib.cli.recipe``).

A ``Stack`` is what one run trains with; each ``Rung`` changes one field of the stack it is put on.
``run_stack`` fine-tunes a copy of the model with the slides' loop (``training.slides.train_pytorch``)
on a stack's data and settings, evaluates on the validation split at fixed points of the data seen
(the clock paused), and reports the training time up to each evaluation, tokens, and peak memory.
"""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from course_lib import data
from course_lib.devices import seed_everything, to_device
from course_lib.instruments.memory import TensorPeak
from course_lib.instruments.timing import Stopwatch
from course_lib.mixed_precision import (
    FASTER,
    advise_precision,
    autocast_dtype,
    cpu_has_fast_bf16,
    precision_label,
)
from course_lib.training import slides
from course_lib.training.metrics import evaluate
from course_lib.training.optim import fused_adamw_supported


@dataclass(frozen=True)
class Stack:
    """What one run trains with. The default is rung 1, the slides' loop."""

    dynamic_padding: bool = False  # False: every batch padded to max_length
    group_by_length: bool = False
    fused_adamw: bool = False  # False: torch.optim.AdamW as the slides write it (its default kernel)
    attention: str = "eager"  # attn_implementation: "eager" or "sdpa"
    precision: str = "no"  # "no" (fp32), "bf16", "fp16"
    compile: bool = False  # torch.compile; compilation counts in the wall time
    batch_mult: int = 1  # batch size x this, learning rate x sqrt(this)


@dataclass(frozen=True)
class Rung:
    """One change to the stack below it: ``name`` (an id), ``label`` (for tables), ``change`` (fields)."""

    name: str
    label: str
    change: dict[str, Any]


def ladder(large_batch: int = 2) -> tuple[Rung, ...]:
    """The rungs in order; rung 6's precision is decided on the machine (``mixed_precision_choice``)."""
    return (
        Rung("slides", "the slides' loop (pad to max_length, fp32, AdamW, eager attention)", {}),
        Rung("dynamic_padding", "dynamic padding (each batch to its longest row)", {"dynamic_padding": True}),
        Rung("length_grouping", "length-grouped batches", {"group_by_length": True}),
        Rung("fused_adamw", "fused AdamW", {"fused_adamw": True}),
        Rung("sdpa", "SDPA attention", {"attention": "sdpa"}),
        Rung("mixed_precision", "mixed precision", {"precision": None}),
        Rung("compile", "torch.compile (from an empty compile cache)", {"compile": True}),
        Rung(
            "large_batch",
            f"batch x{large_batch}, learning rate x{math.sqrt(large_batch):.2f}",
            {"batch_mult": large_batch},
        ),
    )


RUNG_NAMES = tuple(r.name for r in ladder())


def mixed_precision_choice(device: torch.device) -> tuple[str, str]:
    """``(precision, why)``: the mixed precision that pays on ``device``, or ``"no"`` and the reason.

    On a CPU a matmul test decides with the course's one rule, ``mixed_precision.advise_precision``
    (bf16 only where it runs at least ``FASTER`` x fp32); the reason quotes the measured ratio.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16", f"bf16 on a GPU of compute capability {major}.{minor}"
        if major >= 7:
            return "fp16", f"fp16 with a GradScaler on a GPU of compute capability {major}.{minor}"
        return "no", f"a GPU of compute capability {major}.{minor} has no fast 16-bit math"
    if device.type != "cpu":
        return "no", f"not measured on {device.type}"
    from course_lib.instruments.throughput import matmul_gflops

    fp32 = matmul_gflops(torch.float32, device, n=512)["gflops"]
    bf16 = matmul_gflops(torch.bfloat16, device, n=512)["gflops"]
    ratio = bf16 / fp32
    if advise_precision("cpu", {"no": fp32, "bf16": bf16}).fastest == "bf16":
        return "bf16", f"bf16 matmuls measured {ratio:.2f}x fp32 here"
    if not cpu_has_fast_bf16():
        return "no", (
            f"bf16 matmuls measured {ratio:.2f}x fp32 here (not >= {FASTER}x; this CPU has no AVX512-BF16/AMX "
            "instructions): slower, so not tried; fp16 is slower still on CPUs"
        )
    return "no", f"bf16 matmuls measured {ratio:.2f}x fp32 here (not >= {FASTER}x): slower, so not tried"


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here, or None."""
    if sys.platform == "win32":
        return "torch.compile's CPU backend needs a C++ toolchain that Windows setups rarely have"
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version_info.major}.{sys.version_info.minor} here"
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "torch.compile on a CPU needs a C++ compiler (g++ or clang++), and none is installed"
    return None


def skip_reason(rung: Rung, stack: Stack, model: torch.nn.Module, device: torch.device) -> str | None:
    """Why ``rung`` cannot be tried on top of ``stack`` here (None: it can)."""
    if rung.name == "fused_adamw" and not fused_adamw_supported(list(model.parameters())):
        return f"torch has no fused AdamW kernel for {device.type}"
    if rung.name == "sdpa" and not getattr(model, "_supports_sdpa", False):
        return f"{type(model).__name__} has no SDPA attention in this transformers"
    if rung.name == "compile":
        return compile_unavailable(device)
    return None


@dataclass
class Prepared:
    """What every run shares: the model to copy, the tokenizer, the train rows, the evaluation loader."""

    model: torch.nn.Module
    tokenizer: Any
    train: Any
    eval_loader: Any


def prepare(cfg) -> Prepared:
    """Tokenise the embedded data and load the model (seeded head) once: what every run copies.

    The training rows are rounded down to whole batches of the largest batch a run uses, so every
    run sees the same examples per epoch.
    """
    from course_lib.models import load_model, load_tokenizer

    tokenizer = load_tokenizer()
    tokenized = data.tokenize_dataset(data.load_mrpc(), tokenizer)
    whole = cfg.batch_size * (cfg.large_batch if "large_batch" in cfg.rungs else 1)
    train = data.first_rows(tokenized["train"], cfg.train_rows)
    rows = len(train) // whole * whole
    if rows == 0:
        raise ValueError(
            f"{len(train)} training rows make no batch of {whole}: use more rows or a smaller batch."
        )
    evals = data.first_rows(tokenized["validation"], cfg.eval_rows)
    seed_everything(cfg.seed)
    model = load_model()
    return Prepared(model, tokenizer, train.select(range(rows)), data.make_dataloader(evals, tokenizer, 128))


class _Stop(Exception):
    """Raised from the step hook to end a run that reached its target (``stop_at`` set)."""


class _Counting:
    """A DataLoader's batches, counting real and padded tokens and keeping the longest batch."""

    def __init__(self, loader) -> None:
        self.loader, self.real, self.padded, self.longest = loader, 0, 0, None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.real += int(batch["attention_mask"].sum())
            self.padded += batch["input_ids"].numel()
            if self.longest is None or batch["input_ids"].numel() > self.longest["input_ids"].numel():
                self.longest = batch
            yield batch


def apply(rung: Rung, stack: Stack, precision: str = "no") -> Stack:
    """``stack`` with ``rung``'s change (rung 6 takes ``precision``)."""
    change = {k: (precision if v is None else v) for k, v in rung.change.items()}
    return replace(stack, **change)


def run_stack(
    stack: Stack,
    prepared: Prepared,
    cfg,
    device: torch.device,
    stop_at: float | None = None,
    memory: bool = True,
) -> dict[str, Any]:
    """Fine-tune a copy of ``prepared.model`` with ``stack`` per ``cfg`` (a ``RecipeConfig``).

    Evaluates every ``cfg.eval_every`` steps at the base batch size (the same training examples seen
    for every stack) and at the end; the clock runs only while training (evaluation not counted;
    compilation, data loading, forward, backward and the optimizer are). ``stop_at``: end the run at
    the first evaluation with at least that accuracy. Returns the run's measurements.
    """
    seed_everything(cfg.seed)
    model = _copy(prepared.model, stack.attention, device)
    batch_size = cfg.batch_size * stack.batch_mult
    lr = cfg.lr * math.sqrt(stack.batch_mult)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=True if stack.fused_adamw else None
    )
    steps = cfg.epochs * (len(prepared.train) // batch_size)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=steps)
    loader = _Counting(
        data.make_dataloader(
            prepared.train,
            prepared.tokenizer,
            batch_size,
            shuffle=True,
            precision=stack.precision,
            seed=cfg.seed,
            pad_to=None if stack.dynamic_padding else cfg.max_length,
            group_by_length=stack.group_by_length,
            drop_last=True,
        )
    )
    trained = torch.compile(model, dynamic=stack.dynamic_padding or None) if stack.compile else model
    every = cfg.eval_every // stack.batch_mult
    state = {"step": 0, "seconds": 0.0}
    evals: list[dict[str, Any]] = []
    watch = Stopwatch(device)

    def on_step() -> None:
        state["step"] += 1
        if state["step"] % every and state["step"] != steps:
            return
        state["seconds"] += watch.lap()  # training time up to this evaluation
        metrics = evaluate(model, prepared.eval_loader)  # the uncompiled module: same weights, fp32
        evals.append(
            {
                "step": state["step"],
                "examples": state["step"] * batch_size,
                "seconds": state["seconds"],
                "accuracy": metrics["accuracy"],
                "loss": metrics["loss"],
            }
        )
        if stop_at is not None and metrics["accuracy"] >= stop_at:
            raise _Stop
        watch.start()

    losses: list[float] = []
    with _empty_compile_cache(stack.compile):
        watch.start()
        try:
            for _ in range(cfg.epochs):
                epoch_losses, _scaler = slides.train_pytorch(
                    trained, loader, optimizer, scheduler, stack.precision, on_step=on_step
                )
                losses += epoch_losses
        except _Stop:
            pass
        peak = _peak_step_mb(trained, optimizer, loader.longest, stack.precision, device) if memory else None
    seconds = state["seconds"]
    return {
        "steps": state["step"],
        "batch_size": batch_size,
        "lr": lr,
        "train_seconds": seconds,
        "padded_tokens": loader.padded,
        "real_tokens": loader.real,
        "tokens_per_s": loader.padded / seconds if seconds else None,
        "real_tokens_per_s": loader.real / seconds if seconds else None,
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "final_loss": losses[-1] if losses else None,
        "peak_mem_mb": peak,
        "optimizer": "AdamW(fused)" if stack.fused_adamw else "AdamW(default)",
        "evals": evals,
    }


def _empty_compile_cache(enabled: bool):
    """A fresh, empty inductor cache while a compiled run trains: compile time as on a first run.

    Without it a second run would load the kernels a first one compiled and look cheaper than it is.
    """
    if not enabled:
        return contextlib.nullcontext()
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # a private helper: without it the run may reuse a warm cache
        return contextlib.nullcontext()
    return fresh_cache()


def _copy(model: torch.nn.Module, attention: str, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` with ``attention``; its loss type fixed before any compile.

    The first forward pass sets ``config.problem_type``; set here, it does not make a compiled model
    compile a second time.
    """
    model = copy.deepcopy(model)
    model.config.problem_type = model.config.problem_type or "single_label_classification"
    model.set_attn_implementation(attention)
    return model.to(device)


def warm_up(prepared: Prepared, cfg, device: torch.device, steps: int = 2) -> None:
    """A few untimed steps in each padding scheme, attention and AdamW kernel, on a throwaway copy.

    First use costs (allocations, kernel selection, lazy imports) would otherwise land on rung 1,
    which always runs first.
    """
    for attention, fused in (("eager", None), ("sdpa", True)):
        model = _copy(prepared.model, attention, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused)
        for pad_to in (cfg.max_length, None):
            loader = data.make_dataloader(prepared.train, prepared.tokenizer, cfg.batch_size, pad_to=pad_to)
            for _, batch in zip(range(steps), loader):
                batch = to_device(batch, device)
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    evaluate(model, prepared.eval_loader)


def _peak_step_mb(model, optimizer, batch, precision: str, device: torch.device) -> float | None:
    """Peak tensor memory (MiB) of one more training step on the run's longest batch."""
    if batch is None:
        return None
    batch = to_device(batch, device)
    peak = TensorPeak(device)
    peak.start()
    try:
        with torch.autocast(device.type, dtype=autocast_dtype(precision), enabled=precision != "no"):
            loss = model(
                batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    finally:
        mb = peak.stop()
    return None if math.isnan(mb) else mb


def describe(stack: Stack) -> str:
    """The stack in a few words (for the report's last lines)."""
    parts = [
        "dynamic padding" if stack.dynamic_padding else "padding to max_length",
        *(["length-grouped batches"] if stack.group_by_length else []),
        "fused AdamW" if stack.fused_adamw else "AdamW (default kernel)",
        f"{stack.attention} attention",
        precision_label(stack.precision),
        *(["torch.compile"] if stack.compile else []),
        *([f"batch x{stack.batch_mult}"] if stack.batch_mult > 1 else []),
    ]
    return ", ".join(parts)
