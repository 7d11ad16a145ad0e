"""What a benchmark run measures: implementations, model sizes, ``BenchConfig`` and its presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from course_lib.devices import (
    get_device,
)
from course_lib.mixed_precision import best_precision, gpu_has_native_bf16, normalize_precision

IMPLEMENTATIONS = ("pytorch", "accelerate", "trainer", "course")
LABELS = {
    "pytorch": "PyTorch loop",
    "accelerate": "Accelerator",
    "trainer": "Trainer",
    "course": "course loop",
}
# Shapes on top of the embedded checkpoint's config (vocabulary 1,200). None: the checkpoint itself.
MODEL_SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,
    "small": {"dim": 256, "n_layers": 4, "n_heads": 4, "hidden_dim": 1024, "max_position_embeddings": 512},
    "base": {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "max_position_embeddings": 512},
}
BENCH_ABOUT = (
    "One run of the training benchmark (rows, settings, machine, run time), written by `python -m "
    "course_lib.cli.bench --json PATH`. The tables between the bench markers of README.md and docs/benchmark.md "
    "are rendered from docs/results/bench.json by `python -m course_tools.sections render bench` (no measuring). "
    "See docs/results/README.md."
)


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
    memory: bool = True  # peak tensor memory of a short extra run per row (course_lib.instruments.memory)
    memory_steps: int = 2  # optimizer steps of that run

    def __post_init__(self) -> None:
        self.sizes = tuple(check_choice(s, MODEL_SIZES, "model size", "--sizes") for s in self.sizes)
        self.implementations = tuple(
            check_choice(i, IMPLEMENTATIONS, "implementation", "--implementations")
            for i in self.implementations
        )
        if self.precisions is not None:
            # dict.fromkeys: "fp32,no" is one precision, measured once, in the order given
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
        return self.warmup + self.steps + 1  # + 1: a step's time ends where the next forward starts


def quick_config(**overrides: Any) -> BenchConfig:
    """The smoke-test preset: tiny model, fp32 and bf16, a few steps."""
    device = get_device(overrides.get("device"))
    settings: dict[str, Any] = {
        "sizes": ("tiny",),
        "precisions": ("no", "bf16" if device.type != "mps" else "fp16"),
        "warmup": 1,
        "steps": 3,
        "rounds": 2,
        "lr": 1e-3,
    }
    settings.update(overrides)
    return BenchConfig(**settings)


def check_choice(value: str, choices, what: str, flag: str) -> str:
    value = str(value).strip().lower()
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}: use one or more of {', '.join(choices)} ({flag}).")
    return value


def default_precisions(device: torch.device) -> tuple[str, ...]:
    """Precisions worth measuring on ``device``: fp32, plus bf16 where native, plus fp16 on GPUs."""
    if device.type == "cuda":
        return ("no", "bf16", "fp16") if gpu_has_native_bf16(device) else ("no", "fp16")
    if device.type == "mps":
        return ("no", "fp16")
    return ("no", "bf16") if best_precision(device, measure=False) == "bf16" else ("no",)
