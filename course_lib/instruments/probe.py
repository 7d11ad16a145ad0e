"""``StepProbe``: step time and peak tensor memory of any training loop, measured the same way for each.

Plain PyTorch calls ``start()`` before its loop and ``tick()`` after every optimizer step; an
``Accelerator`` loop does the same; the ``Trainer`` gets ``probe_callback(probe)``. Step time is the
``Stopwatch`` lap between ticks; memory is ``TensorPeak`` over the first step (on a CPU the profiler
that measures it slows that step, so medians skip it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from course_lib.instruments.memory import TensorPeak
from course_lib.instruments.timing import Stopwatch, median


@dataclass
class StepProbe:
    """Time each optimizer step and measure the peak tensor memory of the first one."""

    device: torch.device | str = "cpu"
    measure_memory: bool = True
    step_times: list[float] = field(default_factory=list)
    peak_mb: float = float("nan")

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._watch, self._peak = Stopwatch(self.device), TensorPeak(self.device)

    def start(self) -> None:
        """Begin: reset the times, start the memory measurement of the first step."""
        self.step_times, self.peak_mb = [], float("nan")
        if self.measure_memory:
            self._peak.start()
        self._watch.start()

    def tick(self) -> None:
        """After an optimizer step: record its time (and, after the first, the memory peak)."""
        self.step_times.append(self._watch.lap())
        if len(self.step_times) == 1 and self.measure_memory:
            self.peak_mb = self._peak.stop()  # the first step only: on a CPU the profiler slows it
        self._watch.start()  # after stop(): the profiler's teardown stays out of the next lap

    def median_step_time(self, skip: int = 1) -> float:
        """Median seconds per step, ignoring the first ``skip`` (warm-up, and profiled on CPU)."""
        return median(self.step_times, skip)


def probe_callback(probe: StepProbe):
    """A ``transformers.TrainerCallback`` that drives ``probe`` (start at train begin, tick per step)."""
    from transformers import TrainerCallback

    class _ProbeCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.start()

        def on_step_end(self, args, state, control, **kwargs):
            probe.tick()

    return _ProbeCallback()
