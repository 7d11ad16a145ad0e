"""The rungs of the recipe ladder: what one run trains with (``Stack``) and the one change per rung.

Each ``Rung`` changes one field of the stack it is put on, and ``train_settings`` turns a stack into
the course loop's ``TrainConfig`` plus the training batches' settings (``data.make_train_loader``):
exactly what ``python -m course_lib.cli.train`` builds from its flags (``cli_flags``).
``settings_change`` writes a rung's change as the code it sets (a ``TrainConfig`` field, the
collator, the DataLoader). Rungs in ``SAME_FUNCTION`` change only the kernels or the padding: the
model computes the same function (``runs.same_function_losses`` checks it), so their examples to
target are the stack's before.
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from course_lib import data
from course_lib.mixed_precision import FASTER, advise, cpu_has_fast_bf16, precision_label
from course_lib.training import TrainConfig
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
# A stack as the course loop's settings, as the code that sets them, and as the command's flags


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


def settings_code(stack: Stack, cfg) -> dict[str, dict[str, str]]:
    """Where ``stack``'s runs set what they set, as code: the DataLoader's, the collator's, ``TrainConfig``'s."""
    train_cfg, loader = train_settings(stack, cfg, cfg.seed)
    if loader["pad_to"] is None:  # dynamic padding: to each batch's longest row (a multiple of 8 under amp)
        collator = {"pad_to_multiple_of": repr(data.pad_multiple(loader["precision"]))}
    else:  # the slides' padding
        collator = {"padding": "'max_length'", "max_length": repr(loader["pad_to"])}
    sampler = "LengthGroupedBatchSampler(lengths, batch_size)" if loader["group_by_length"] else "None"
    fields = ("lr", "precision", "fused_optimizer", "attn_implementation", "compile", "compile_dynamic")
    values = {f: getattr(train_cfg, f) for f in fields}
    return {
        "DataLoader": {"batch_size": repr(loader["batch_size"]), "batch_sampler": sampler},
        "DataCollatorWithPadding": collator,
        "TrainConfig": {f: f"{v:.3g}" if isinstance(v, float) else repr(v) for f, v in values.items()},
    }


def settings_change(before: Stack | None, after: Stack, cfg) -> str:
    """What ``after`` sets that ``before`` does not, as code (``before`` None: all that ``after`` sets)."""
    old = settings_code(before, cfg) if before is not None else {}
    parts = []
    for name, args in settings_code(after, cfg).items():
        if name == "DataCollatorWithPadding" and args != old.get(name):  # another collator: all its arguments
            changed = ["tokenizer"] + [f"{k}={v}" for k, v in args.items() if v != "None"]
        else:
            changed = [f"{k}={v}" for k, v in args.items() if v != old.get(name, {}).get(k) and v != "None"]
        parts += [f"{name}({', '.join(changed)})"] if changed else []
    return "; ".join(parts)


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


def describe_stack(stack: Stack) -> str:
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
