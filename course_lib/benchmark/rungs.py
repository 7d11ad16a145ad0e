"""The rungs of the recipe ladder and its two measurements, through the course loop (``training.train``).

A ``Stack`` is what one run trains with; each ``Rung`` changes one field of the stack it is put on,
and ``train_settings`` turns a stack into the course loop's ``TrainConfig`` plus the training
batches' settings (``data.make_train_loader``): exactly what ``python -m course_lib.cli.train`` builds
from its flags (``cli_flags``). Time to target is measured as two factors:

* ``throughput_run``: examples per second over the same training rows for every stack (``timed_rows``),
  batched the stack's own way; the ladder interleaves them in rounds (``benchmark.recipe``).
* ``accuracy_run``: the validation accuracy after every ``eval_every`` batches of training examples,
  for one seed; the examples seen when it first reaches the target are its examples to target.

Rungs in ``SAME_FUNCTION`` change only the kernels or the padding: the model computes the same
function (``same_function_losses`` checks it), so their examples to target are the stack's before.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from course_lib import data
from course_lib.devices import seed_everything
from course_lib.distributed import disable_dropout
from course_lib.mixed_precision import FASTER, advise, cpu_has_fast_bf16, precision_label
from course_lib.training import TrainConfig, train
from course_lib.training.metrics import evaluate
from course_lib.training.optim import fused_adamw_supported


@dataclass(frozen=True)
class Stack:
    """What one run trains with. The default is rung 1, the slides' settings."""

    dynamic_padding: bool = False  # False: every batch padded to max_length
    group_by_length: bool = False
    # False: torch.optim.AdamW's default kernel, as the slides write it (for-loop on CPUs, foreach on GPUs)
    fused_adamw: bool = False
    attention: str = "eager"  # attn_implementation: "eager" or "sdpa"
    precision: str = "no"  # "no" (fp32), "bf16", "fp16"
    compile: bool = False  # torch.compile; compilation counts in the time to target
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
        Rung("slides", "the slides' settings (pad to max_length, fp32, AdamW, eager attention)", {}),
        Rung("dynamic_padding", "dynamic padding (each batch to its longest row)", {"dynamic_padding": True}),
        Rung("length_grouping", "length-grouped batches", {"group_by_length": True}),
        Rung("fused_adamw", "fused AdamW", {"fused_adamw": True}),
        Rung("sdpa", "SDPA attention", {"attention": "sdpa"}),
        Rung("mixed_precision", "mixed precision", {"precision": None}),
        Rung("compile", "torch.compile (compilation counted)", {"compile": True}),
        Rung(
            "large_batch",
            f"batch x{large_batch}, learning rate x{math.sqrt(large_batch):.2f}",
            {"batch_mult": large_batch},
        ),
    )


RUNG_NAMES = tuple(r.name for r in ladder())
# Kernels or padding only: the same function of the same parameters (a test checks the losses agree).
SAME_FUNCTION = ("dynamic_padding", "fused_adamw", "sdpa", "compile")


def mixed_precision_choice(device: torch.device) -> tuple[str, str]:
    """``(precision, why)``: the mixed precision to try on ``device``, or ``"no"`` and the reason.

    Measured on every device by the course's one rule, ``mixed_precision.advise`` (a matmul test; a
    usable format only where it runs at least ``FASTER`` x fp32); the reason quotes the measured
    ratios of the usable formats (fp16 on a CPU is the trap of lesson 03: never tried there). The
    rung then measures the training itself.
    """
    if device.type not in ("cpu", "cuda"):
        return "no", f"not measured on {device.type}"
    advice = advise(device)
    usable = {p: s for p, s in advice.speedups.items() if p not in advice.unusable}
    ratios = ", ".join(f"{precision_label(p)} {s:.2f}x" for p, s in usable.items())
    if advice.fastest != "no":
        return advice.fastest, f"matmuls measured {ratios} fp32 here"
    why = f"matmuls measured {ratios} fp32 here"
    if device.type == "cpu" and not cpu_has_fast_bf16():
        why += "; this CPU has no AVX512-BF16/AMX instructions"
    return "no", why + f": not at least {FASTER}x faster, so not tried"


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


def skip_reason(rung: Rung, model: torch.nn.Module, device: torch.device) -> str | None:
    """Why ``rung`` cannot be tried here (None: it can)."""
    if rung.name == "fused_adamw" and not fused_adamw_supported(list(model.parameters())):
        return f"torch has no fused AdamW kernel for {device.type}"
    if rung.name == "sdpa" and not getattr(model, "_supports_sdpa", False):
        return f"{type(model).__name__} has no SDPA attention in this transformers"
    if rung.name == "compile":
        return compile_unavailable(device)
    return None


def apply(rung: Rung, stack: Stack, precision: str = "no") -> Stack:
    """``stack`` with ``rung``'s change (rung 6 takes ``precision``)."""
    change = {k: (precision if v is None else v) for k, v in rung.change.items()}  # None: decided here
    return replace(stack, **change)


# ---------------------------------------------------------------------------------------------
# A stack as the course loop's settings, and as the training command's flags


def train_settings(stack: Stack, cfg, seed: int, max_steps: int | None = None) -> tuple[TrainConfig, dict]:
    """``(TrainConfig, loader settings)`` of ``stack`` under the ladder's ``cfg`` (a ``RecipeConfig``)."""
    train_cfg = TrainConfig(
        epochs=cfg.epochs,
        max_steps=max_steps,
        lr=cfg.lr * math.sqrt(stack.batch_mult),  # square-root scaling for Adam (Malladi et al. 2022)
        weight_decay=cfg.weight_decay,
        precision=stack.precision,
        seed=seed,
        device=cfg.device,
        progress=False,
        eval_every_epoch=False,
        fused_optimizer=stack.fused_adamw,
        attn_implementation=stack.attention,
        compile=stack.compile,
        compile_dynamic=True if stack.compile and stack.dynamic_padding else None,  # lengths vary per batch
    )
    loader = {
        "batch_size": cfg.batch_size * stack.batch_mult,
        "precision": stack.precision,
        "seed": seed,
        "pad_to": None if stack.dynamic_padding else cfg.max_length,
        "group_by_length": stack.group_by_length,
    }
    return train_cfg, loader


def cli_flags(stack: Stack, cfg, train_rows: int | None = None) -> list[str]:
    """The ``python -m course_lib.cli.train`` flags that train ``stack`` (``cfg.seed``, ``cfg``'s data)."""
    train_cfg, loader = train_settings(stack, cfg, cfg.seed)
    flags = [
        "--epochs",
        str(cfg.epochs),
        "--batch-size",
        str(loader["batch_size"]),
        "--lr",
        repr(train_cfg.lr),
    ]
    flags += ["--precision", stack.precision, "--attn-implementation", stack.attention]
    flags += [
        "--padding",
        "dynamic" if stack.dynamic_padding else "max_length",
        "--max-length",
        str(cfg.max_length),
    ]
    flags += ["--group-by-length"] if stack.group_by_length else []
    flags += ["--fused-adamw", "yes" if stack.fused_adamw else "no"]
    flags += ["--compile"] if stack.compile else []
    flags += ["--train-rows", str(train_rows)] if train_rows is not None else []
    flags += ["--eval-rows", str(cfg.eval_rows)] if cfg.eval_rows is not None else []
    return flags + ["--seed", str(cfg.seed)]


# ---------------------------------------------------------------------------------------------
# The runs


@dataclass
class Prepared:
    """What every run shares: model to copy, tokenizer, train rows, evaluation loader, ``timed_rows``."""

    model: torch.nn.Module
    tokenizer: Any
    train: Any
    eval_loader: Any
    timed: Any  # the rows every throughput run times (``timed_rows``)


def timed_rows(train_rows, cfg):
    """``cfg.timed_steps`` x ``cfg.batch_size`` random rows (``cfg.seed``; whole largest batches): every stack's."""
    # [same rows] an epoch's first batches are other rows under length grouping or a larger batch, and
    # their token counts differ by as much as the gains decided on: time every stack on these rows
    whole = cfg.batch_size * (cfg.large_batch if "large_batch" in cfg.rungs else 1)
    n = min(len(train_rows), -(-cfg.timed_steps * cfg.batch_size // whole) * whole)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(cfg.seed))
    return train_rows.select(sorted(order[:n].tolist()))


def prepare(cfg) -> Prepared:
    """Tokenise the embedded data and load the model (seeded head) once: what every run copies.

    The training rows are rounded down to whole batches of the largest batch a run uses, so every
    run sees the same examples per epoch.
    """
    from course_lib.models import load_model, load_tokenizer

    tokenizer = load_tokenizer()
    tokenized = data.tokenize_dataset(data.load_mrpc(), tokenizer, cfg.max_length)
    whole = cfg.batch_size * (cfg.large_batch if "large_batch" in cfg.rungs else 1)
    train_rows = data.first_rows(tokenized["train"], cfg.train_rows)
    rows = len(train_rows) // whole * whole
    if rows == 0:
        raise ValueError(
            f"{len(train_rows)} training rows make no batch of {whole}: use more rows or a smaller batch."
        )
    evals = data.first_rows(tokenized["validation"], cfg.eval_rows)
    seed_everything(cfg.seed)
    model = load_model()
    model.config.problem_type = "single_label_classification"  # what the first forward pass would set
    eval_loader = data.make_dataloader(evals, tokenizer, 128)
    # Its own generator: an evaluation mid-run then draws no number from the global RNG (dropout's).
    eval_loader.generator = torch.Generator().manual_seed(cfg.seed)
    train = train_rows.select(range(rows))
    return Prepared(model, tokenizer, train, eval_loader, timed_rows(train, cfg))


def _loader(stack: Stack, prepared: Prepared, cfg, seed: int, device: torch.device):
    _, settings = train_settings(stack, cfg, seed)
    return data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)


def timed_loader(stack: Stack, prepared: Prepared, cfg, device: torch.device):
    """The timed rows in ``stack``'s batches, one pass shuffled by ``cfg.seed`` (a fresh loader: the same)."""
    _, settings = train_settings(stack, cfg, cfg.seed)
    loader = data.make_train_loader(prepared.timed, prepared.tokenizer, device=device, **settings)
    if stack.group_by_length:  # the split's rule (>= 4 mega-batches) would give so few rows 1-batch ones
        loader.batch_sampler.mega_batches = len(loader)  # a few batches: sorted as one mega-batch
    return loader


class _WarmUpThenTimed:
    """The warm-up batches, then one pass over the timed rows' batches: one epoch of the course loop."""

    def __init__(self, warm_up: list, timed) -> None:
        self.warm_up, self.timed = warm_up, timed

    def __len__(self) -> int:
        return len(self.warm_up) + len(self.timed)

    def __iter__(self):
        yield from self.warm_up
        yield from self.timed


def accuracy_run(
    stack: Stack, prepared: Prepared, cfg, seed: int, device: torch.device, stop_at: int | None = None
) -> dict[str, Any]:
    """Train ``stack`` with ``seed`` for the budget; evaluate every ``cfg.eval_every`` base batches.

    Returns ``evals`` (examples seen, correct validation rows, accuracy) and the final correct count.
    ``stop_at``: end the run (through ``on_step``) at the first evaluation with at least that many
    correct rows. Runs with dynamic padding and without compilation: the same function (tested).
    """
    stack = replace(stack, dynamic_padding=True, compile=False)
    train_cfg, settings = train_settings(stack, cfg, seed)
    model = copy.deepcopy(prepared.model)
    loader = _loader(stack, prepared, cfg, seed, device)
    every = cfg.eval_every // stack.batch_mult  # eval_every counts base batches; a step holds batch_mult
    steps = cfg.epochs * len(loader)
    evals: list[dict[str, Any]] = []
    n = len(prepared.eval_loader.dataset)

    def on_step(step: int) -> bool:
        if step % every and step != steps:
            return False
        accuracy = evaluate(model, prepared.eval_loader)["accuracy"]  # fp32, the uncompiled module
        correct = round(accuracy * n)  # a count: the target compares rows, not rounded fractions
        evals.append({"examples": step * settings["batch_size"], "correct": correct, "accuracy": correct / n})
        return stop_at is not None and correct >= stop_at

    history = train(model, loader, train_cfg, on_step=on_step)
    return {"seed": seed, "evals": evals, "final_correct": evals[-1]["correct"], "losses": history.losses}


def examples_to(evals: list[dict[str, Any]], target_correct: int) -> int | None:
    """Training examples seen at the first evaluation with at least ``target_correct`` (None: never)."""
    return next((e["examples"] for e in evals if e["correct"] >= target_correct), None)


def throughput_run(
    stack: Stack, prepared: Prepared, cfg, device: torch.device, fresh_compile: bool = False
) -> dict[str, Any]:
    """Examples (and tokens) per second over the timed rows, after ``cfg.warmup_steps`` untimed steps.

    ``fresh_compile``: compile from an empty cache and report ``compile_s``, the warm-up steps' time
    beyond that of as many timed steps.
    """
    warm = list(itertools.islice(_loader(stack, prepared, cfg, cfg.seed, device), cfg.warmup_steps))
    loader = _WarmUpThenTimed(warm, timed_loader(stack, prepared, cfg, device))
    train_cfg, _ = train_settings(stack, cfg, cfg.seed, max_steps=len(loader))
    with _fresh_compile(stack.compile and fresh_compile):
        history = train(copy.deepcopy(prepared.model), loader, train_cfg)
    timed = history.step_times[len(warm) :]
    seconds = sum(timed)
    tokens = data.padding_counts(timed_loader(stack, prepared, cfg, device))
    out = {
        "examples_per_s": len(prepared.timed) / seconds,
        "tokens_per_s": tokens["padded"] / seconds,
        "real_tokens_per_s": tokens["real"] / seconds,
    }
    if stack.compile and fresh_compile:
        warm = history.step_times[: cfg.warmup_steps]
        # the warm-up beyond as many steps at the timed rate; max(0): noise can make that negative
        out["compile_s"] = max(0.0, sum(warm) - len(warm) * seconds / len(timed))
    return out


def _fresh_compile(enabled: bool):
    """An empty dynamo and inductor cache: compilation costs what it costs on a first run."""
    if not enabled:
        return contextlib.nullcontext()
    import torch._dynamo

    torch._dynamo.reset()
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # a private helper: without it a warm on-disk cache may make compiling cheaper
        return contextlib.nullcontext()
    return fresh_cache()


def warm_up(prepared: Prepared, cfg, device: torch.device) -> None:
    """Untimed steps in each padding scheme, attention and AdamW kernel on throwaway copies, and one
    evaluation: first-use costs (allocations, lazy imports) would otherwise land on the first rung."""
    for stack in (Stack(), Stack(dynamic_padding=True, fused_adamw=True, attention="sdpa")):
        train_cfg, settings = train_settings(stack, cfg, cfg.seed, max_steps=2)
        loader = data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)
        train(copy.deepcopy(prepared.model), loader, train_cfg)
    evaluate(copy.deepcopy(prepared.model).to(device), prepared.eval_loader)


def same_function_losses(
    stacks: list[Stack], prepared: Prepared, cfg, device: torch.device, steps: int = 3
) -> list[list[float]]:
    """The training losses of ``steps`` steps of each stack from the same weights, without dropout.

    Dropout draws its masks from tensors of the batch's shape, so with dropout on, another padding
    draws other masks: a different sample of the same random function, not a different function.
    """
    model = disable_dropout(copy.deepcopy(prepared.model))
    out = []
    for stack in stacks:
        train_cfg, settings = train_settings(stack, cfg, cfg.seed, max_steps=steps)
        loader = data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)
        out.append(train(copy.deepcopy(model), loader, train_cfg).losses)
    return out


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
