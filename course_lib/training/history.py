"""What a training run measured: per-step loss, time, tokens and gradient norm, evaluations, loss-scaler state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from course_lib.instruments.timing import median


@dataclass
class History:
    """What a run measured: per-step loss, time and tokens, plus evaluations."""

    config: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds per optimizer step
    step_tokens: list[int] = field(default_factory=list)  # padded tokens per optimizer step
    evals: list[dict[str, float]] = field(default_factory=list)
    scaler_scales: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm before clipping, per step
    skipped_steps: int = 0  # fp16 steps the GradScaler skipped (inf/nan gradients)

    def tokens_per_s(self, skip: int = 1) -> float:
        """Median tokens per second over optimizer steps, ignoring the first ``skip`` (warm-up)."""
        return median([tok / t for tok, t in zip(self.step_tokens, self.step_times)], skip)

    def median_step_time(self, skip: int = 1) -> float:
        """Median seconds per optimizer step, ignoring the first ``skip`` (warm-up)."""
        return median(self.step_times, skip)
