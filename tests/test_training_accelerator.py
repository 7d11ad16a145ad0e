"""training/accelerator.py: the loop's Accelerator backend records what the GradScaler did."""

import torch

from course_lib.training.accelerator import AcceleratorSteps
from course_lib.training.history import History


class _Optimizer:
    def __init__(self, skipped: bool) -> None:
        self.steps, self.step_was_skipped = 0, skipped

    def step(self) -> None:
        self.steps += 1


class _Accelerator:
    device, mixed_precision, is_main_process = torch.device("cpu"), "fp16", True

    def __init__(self, scaler) -> None:
        self.scaler = scaler


def test_a_skipped_fp16_step_under_an_accelerator_is_recorded():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert scaler.is_enabled(), "premise: an enabled scaler, as Accelerate keeps for fp16 on a GPU"
    steps, history = AcceleratorSteps(_Accelerator(scaler)), History(config={})
    for skipped in (False, True, True):
        optimizer = _Optimizer(skipped)
        steps.step(optimizer, history)
        assert optimizer.steps == 1
    assert history.skipped_steps == 2
    assert history.scaler_scales == [1024.0, 1024.0, 1024.0]


def test_without_a_scaler_nothing_is_recorded():
    steps, history, optimizer = AcceleratorSteps(_Accelerator(None)), History(config={}), _Optimizer(False)
    steps.step(optimizer, history)
    assert (optimizer.steps, history.skipped_steps, history.scaler_scales) == (1, 0, [])
