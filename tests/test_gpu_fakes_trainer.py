"""Trainer on one process with several (fake) GPUs: lessons 03 and 04 keep it on one device.

transformers 5.24 counts every GPU of a single process (``args.n_gpu``) and trains ``per_device x n_gpu``
rows a micro-batch through ``nn.DataParallel``; the lessons print and compare windows of
``per_device`` rows, so they pass their arguments through ``devices.one_trainer_device``.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from test_gpu_fakes import FakeCuda

from course_lib import devices

ROOT = Path(__file__).resolve().parents[1]
TRAINER_LESSONS = ("03_mixed_precision", "04_accumulation_checkpointing")


def _arguments(monkeypatch, tmp_path, gpus: int):
    from accelerate.state import AcceleratorState, PartialState
    from transformers import TrainingArguments

    FakeCuda(monkeypatch, capability=(8, 0), count=gpus)
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_to.append(torch.device(device)))
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none")
    return args, set_to


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def test_trainer_spreads_one_process_over_every_gpu_unless_kept_on_one(monkeypatch, tmp_path):
    args, set_to = _arguments(monkeypatch, tmp_path, gpus=2)
    # the premise: Trainer sees both fake GPUs and would train 16-row micro-batches with nn.DataParallel
    assert args.device == torch.device("cuda:0") and set_to == [torch.device("cuda:0")]
    assert (args.n_gpu, args.train_batch_size) == (2, 16)
    assert devices.one_trainer_device(args) is args
    assert (args.n_gpu, args.train_batch_size) == (1, 8)  # the rows the lesson prints and compares


@pytest.mark.parametrize("gpus", [1, 0])
def test_one_device_or_none_is_left_as_it_is(monkeypatch, tmp_path, gpus):
    if gpus:
        args, _ = _arguments(monkeypatch, tmp_path, gpus=1)
        expected = 1
    else:
        from transformers import TrainingArguments

        args, expected = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), 0
    devices.one_trainer_device(args)
    assert args.n_gpu == expected and args.train_batch_size == args.per_device_train_batch_size


@pytest.mark.parametrize("lesson", TRAINER_LESSONS)
def test_the_lessons_keep_every_trainer_they_build_on_one_device(lesson):
    nb = nbformat.read(ROOT / "notebooks" / f"{lesson}.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    built = list(re.finditer(r"^\s*(\w+)\s*=\s*TrainingArguments\(", code, re.M))
    assert built, f"{lesson} builds no TrainingArguments: update TRAINER_LESSONS"
    for i, match in enumerate(built):  # each assignment, up to the next one
        name, end = match.group(1), built[i + 1].start() if i + 1 < len(built) else len(code)
        assert f"one_trainer_device({name})" in code[match.end() : end], (
            f"{lesson}: pass {name} through devices.one_trainer_device before a Trainer uses it (several "
            "GPUs in one process would make Trainer train per_device x n_gpu rows a micro-batch)"
        )
