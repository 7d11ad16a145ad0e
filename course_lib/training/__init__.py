"""The course's one training loop (``loop.py``), with one file per technique it adds.

loop         ``train`` and ``TrainConfig``: forward, loss, backward, step, plus tagged technique lines
backend      ``Backend``: the protocol of what the loop calls on its backend (TorchAmp, AcceleratorSteps)
amp          [amp] autocast + GradScaler with plain PyTorch (the ``TorchAmp`` backend)
accelerator  [accelerator] the same loop through an ``Accelerator`` (the ``AcceleratorSteps`` backend); ``fresh_accelerator``
accum        [accum] gradient accumulation over micro-batches
ddp          [ddp] no all-reduce mid-accumulation, a new shuffle each epoch
clip         [clip] gradient clipping on unscaled gradients
resume       [resume] continue a checkpointed run from an optimizer step
optim        [optim] AdamW (fused where torch has the kernel), Adafactor, 8-bit AdamW; the schedule
activation_checkpointing  [activation_checkpointing] recompute a Hugging Face model's activations in backward
fsdp         [fsdp] shard parameters, gradients and optimizer state over the ranks (FSDP2 fully_shard)
local_sgd    [local_sgd] average parameters every N steps instead of gradients every step
kernels      [kernels] attention implementation (eager, SDPA) and torch.compile: same function, other kernels
metrics      ``evaluate`` and ``accuracy_f1``
history      ``History``: what a run measured
slides       the slides' own loops (PyTorch, Accelerator): the references lessons and benchmark use
"""

from course_lib.training.accelerator import amp_is_active, fresh_accelerator
from course_lib.training.activation_checkpointing import enable_checkpointing
from course_lib.training.history import History
from course_lib.training.kernels import ATTENTION
from course_lib.training.loop import TrainConfig, build_optimizer, train
from course_lib.training.metrics import accuracy_f1, evaluate
from course_lib.training.optim import (
    OPTIMIZERS,
    TRAINER_OPTIM,
    fused_adamw_supported,
    make_optimizer,
    make_scheduler,
)

__all__ = [
    "ATTENTION",
    "OPTIMIZERS",
    "TRAINER_OPTIM",
    "History",
    "TrainConfig",
    "accuracy_f1",
    "amp_is_active",
    "build_optimizer",
    "enable_checkpointing",
    "evaluate",
    "fresh_accelerator",
    "fused_adamw_supported",
    "make_optimizer",
    "make_scheduler",
    "train",
]
