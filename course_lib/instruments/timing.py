"""Step time, defined once: synchronised wall-clock time between two step boundaries.

Medians, not means: one interrupted step must not move the figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.devices import get_device, synchronize


def median(values: list[float], skip: int = 0) -> float:
    """Median of ``values`` after the first ``skip`` (warm-up); all of them if that leaves none."""
    kept = values[skip:] or values  # too few values to skip: keep them all
    return statistics.median(kept) if kept else float("nan")


class Stopwatch:
    """Synchronised laps on ``device``: ``lap()`` returns the seconds since the previous lap (or start)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = get_device(device) if not isinstance(device, torch.device) else device
        self.last: float | None = None

    def now(self) -> float:
        # note: a CPU-GPU sync point: queued GPU work ends before the clock is read (no-op on CPU)
        synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.last = self.now()

    def lap(self) -> float:
        if self.last is None:
            raise RuntimeError("Stopwatch.lap() before start(): call start() where the first lap begins.")
        now = self.now()
        seconds, self.last = now - self.last, now
        return seconds


@dataclass
class Timing:
    """Seconds per call: the median and every repeat."""

    median: float
    times: list[float]

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.times) - min(self.times)) / self.median if self.median else float("nan")


def time_fn(fn: Callable[[], object], warmup: int = 2, repeat: int = 5, device=None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` synchronised, timed calls."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}.")
    for _ in range(warmup):
        fn()
    watch, times = Stopwatch(device), []
    for _ in range(repeat):
        watch.start()
        fn()
        times.append(watch.lap())
    return Timing(statistics.median(times), times)


class StepClock:
    """A lap at the start of every forward pass of ``model``: step times of code we cannot edit.

    A forward pre-hook reads the ``Stopwatch``; a step is the time from one forward to the next, so it
    covers data loading, forward, backward, the optimizer and a library's own bookkeeping (Trainer).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None) -> None:
        self.watch, self.stamps = Stopwatch(device), []
        self._handle = model.register_forward_pre_hook(self._stamp)

    def _stamp(self, module, args) -> None:
        # every forward counts, so accumulation's micro-steps and evaluation count too
        self.stamps.append(self.watch.now())

    def periods(self) -> list[float]:
        """Seconds between consecutive forward passes (one per step)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def remove(self) -> None:
        self._handle.remove()
