"""The course's one training loop: the slides' four lines, plus one visible line per technique.

Read ``train`` top to bottom: forward, loss, backward, step. Every other line belongs to a technique
and carries its tag; each tag names the file of this package that holds what the technique does:

* ``# [amp]``         ``amp.py``          autocast for fp16/bf16, a ``GradScaler`` for fp16 only
* ``# [accelerator]`` ``accelerator.py``  the same loop driven by an ``Accelerator`` (placement, DDP)
* ``# [accum]``       ``accum.py``        one optimizer step over ``grad_accum_steps`` micro-batches
* ``# [ddp]``         ``ddp.py``          no all-reduce mid-accumulation, a new shuffle each epoch
* ``# [clip]``        ``clip.py``         gradient clipping, after unscaling
* ``# [resume]``      ``resume.py``       continue from optimizer step ``start_step``; ``on_step`` hook
* ``# [optim]``       ``optim.py``        the optimizer (AdamW, Adafactor, 8-bit AdamW) and its schedule
* ``# [activation_checkpointing]`` ``activation_checkpointing.py`` recompute activations in backward,
  not keep them
* ``# [local_sgd]``   ``local_sgd.py``    average parameters every ``local_sgd_steps`` steps, not gradients
* ``# [fsdp]``        ``fsdp.py``         shard parameters, gradients and optimizer state over the ranks
* ``# [kernels]``     ``kernels.py``      the attention implementation and ``torch.compile`` (same function)

The loop runs on one of two backends: ``TorchAmp`` (placement + ``torch.amp``) without an
``Accelerator``, ``AcceleratorSteps`` with one. ``backend.Backend`` (a ``typing.Protocol``) lists what
the loop asks of them: seven calls (prepare, to_device, autocast, backward, step and eval_args here,
unscale in ``clip.py``) and three attributes (device, precision, is_main_process), so the loop has no
branch per technique. Tests keep the tags and the files, and the protocol and its callers, in step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from course_lib.devices import get_device, seed_everything
from course_lib.instruments.timing import Stopwatch
from course_lib.mixed_precision import check_precision
from course_lib.training.accelerator import AcceleratorSteps
from course_lib.training.accum import micro_batches, run_steps, steps_per_epoch
from course_lib.training.activation_checkpointing import enable_checkpointing
from course_lib.training.amp import TorchAmp
from course_lib.training.backend import Backend
from course_lib.training.clip import clip_gradients
from course_lib.training.ddp import COMM_HOOKS, register_comm_hook, set_epoch, sync_gradients
from course_lib.training.fsdp import require_sharded, shard_model
from course_lib.training.history import History
from course_lib.training.kernels import ATTENTION, compiled, set_attention
from course_lib.training.local_sgd import local_sgd
from course_lib.training.metrics import evaluate
from course_lib.training.optim import OPTIMIZERS, make_optimizer, make_scheduler
from course_lib.training.resume import resume_position

PROGRESS_INTERVAL = 1.0  # seconds between progress-bar redraws (a bounded number of kernel messages)
PROGRESS_REDRAWS = 20  # and at most about this many redraws per run, however slow the steps (a count)


@dataclass
class TrainConfig:
    """Settings of one training run (log it with ``dataclasses.asdict``)."""

    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: run all epochs
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    precision: str = "no"  # "no" | "fp16" | "bf16"
    grad_accum_steps: int = 1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str | None = None  # None: auto (cuda, mps, cpu); ignored with an Accelerator
    progress: bool = True
    eval_every_epoch: bool = True
    optimizer: str = "adamw"  # "adamw" | "adafactor" | "adamw8bit" (ignored when an optimizer is passed)
    gradient_checkpointing: bool = False
    local_sgd_steps: int | None = None  # average parameters every N steps (N processes); None: DDP
    comm_hook: str = "none"  # "none" | "fp16" | "bf16": compress the gradients DDP all-reduces
    fused_optimizer: bool | None = None  # fused AdamW; None: where torch has it, False: torch's default
    attn_implementation: str | None = None  # "eager" | "sdpa"; None: as the model was loaded
    compile: bool = False  # torch.compile the model for training (compilation counts in the step times)
    compile_dynamic: bool | None = None  # torch.compile(dynamic=...): True where batch lengths vary
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the ranks (FSDP2), not DDP

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}.")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)}, got {self.comm_hook!r}.")
        if self.local_sgd_steps is not None and self.local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps must be >= 1 (or None), got {self.local_sgd_steps}.")
        if self.local_sgd_steps and self.comm_hook != "none":
            raise ValueError(
                "comm_hook compresses DDP's per-step gradient all-reduce, which local_sgd_steps turns off "
                "(it averages parameters instead): use one of the two."
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or None: all epochs), got {self.max_steps}.")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                f"max_grad_norm must be positive (or None: no clipping), got {self.max_grad_norm}."
            )
        if self.weight_decay < 0 or not 0 <= self.warmup_ratio < 1:
            raise ValueError(
                f"weight_decay must be >= 0 and warmup_ratio in [0, 1), got {self.weight_decay} and "
                f"{self.warmup_ratio}."
            )
        if self.fused_optimizer is not None and self.optimizer != "adamw":
            raise ValueError("fused_optimizer applies to optimizer adamw only: leave it None for the others.")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}.")
        if self.epochs < 1 and not self.max_steps:
            raise ValueError("Set epochs >= 1 or max_steps >= 1: there is nothing to train.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")
        if self.fsdp and (self.local_sgd_steps is not None or self.comm_hook != "none"):
            raise ValueError(
                "fsdp shards the model and reduce-scatters its gradients; local_sgd_steps and comm_hook change "
                "DDP's gradient all-reduce, which FSDP does not run: use fsdp or those, not both."
            )
        if self.fsdp and self.optimizer != "adamw":
            raise ValueError(
                f"fsdp runs with optimizer adamw only: on FSDP2's DTensor shards {self.optimizer!r} raises "
                "(torch 2.13's Adafactor and bitsandbytes' 8-bit kernels take no DTensor). Use adamw, or no fsdp."
            )
        if self.attn_implementation not in (None, *ATTENTION):
            raise ValueError(
                f"attn_implementation must be one of {', '.join(ATTENTION)} (or None), got {self.attn_implementation!r}."
            )


def build_optimizer(model: torch.nn.Module, config: TrainConfig, accelerator=None) -> torch.optim.Optimizer:
    """The run's optimizer per ``config``, on the parameters it will train: under ``config.fsdp`` the
    model is sharded first, in place (on the accelerator's device), since the optimizer must hold the
    shards. The one place that decides both; ``train`` calls it when no optimizer is passed."""
    if config.fsdp and accelerator is not None:
        model.to(accelerator.device)  # shard where the model trains (a GPU per process)
    shard_model(model, config.fsdp, accelerator)  # [fsdp] before the optimizer: it must hold the shards
    return make_optimizer(  # [optim]
        model, config.lr, config.weight_decay, fused=config.fused_optimizer, name=config.optimizer
    )


def train(
    model: torch.nn.Module,
    train_dataloader,
    config: TrainConfig | None = None,
    eval_dataloader=None,
    accelerator=None,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    on_step: Callable[[int], bool | None] | None = None,
) -> History:
    """Fine-tune ``model`` on ``train_dataloader`` per ``config``; return the measured ``History``.

    Without ``accelerator`` the loop moves model and batches to ``config.device`` itself. With an
    ``Accelerator`` it calls ``accelerator.prepare`` on the model, optimizer and dataloaders (pass
    them unprepared) and the precision comes from the Accelerator.

    Resuming: load the model and optimizer state (and the RNG state) first, then pass
    ``start_step``: the learning-rate schedule and the data continue from that optimizer step.
    ``on_step(step)`` runs after every optimizer step (e.g. to save a checkpoint or evaluate); when it
    returns True the run ends there (early stopping), as if ``max_steps`` had been that step.
    """
    cfg = config or TrainConfig()
    k = cfg.grad_accum_steps
    if start_step == 0:
        seed_everything(cfg.seed)  # [resume] a resumed run keeps the RNG state its caller restored
    if len(train_dataloader) == 0:
        raise ValueError("The training DataLoader is empty: there is nothing to train on.")
    set_attention(model, cfg.attn_implementation)  # [kernels]
    if optimizer is None:
        optimizer = build_optimizer(model, cfg, accelerator)  # [optim] [fsdp] shards first under fsdp
    else:
        require_sharded(model, cfg.fsdp, accelerator)  # [fsdp] one built before sharding updates nothing
    enable_checkpointing(model, cfg.gradient_checkpointing)  # [activation_checkpointing]
    if accelerator is not None:
        backend: Backend = AcceleratorSteps(accelerator)  # [accelerator]
    else:
        device = get_device(cfg.device)
        backend = TorchAmp(device, check_precision(cfg.precision, device))  # [amp]
    model, optimizer, train_dataloader, eval_dataloader = backend.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    register_comm_hook(model, cfg.comm_hook)  # [ddp] after prepare wrapped DDP; default none: fp32 all-reduce
    forward = compiled(model, cfg.compile, cfg.compile_dynamic)  # [kernels] same parameters, fused kernels
    # Counted after prepare: under N processes each one sees 1/N of the batches.
    per_epoch = steps_per_epoch(len(train_dataloader), k)  # [accum]
    total_steps = run_steps(len(train_dataloader), k, cfg.epochs, cfg.max_steps)
    scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio, start_step)  # [resume]
    first_epoch, skip = resume_position(start_step, per_epoch, k)  # [resume]

    history = History(config={**asdict(cfg), "precision": backend.precision, "device": str(backend.device)})
    bar = tqdm(
        initial=start_step,
        total=total_steps,
        desc=f"train ({backend.precision})",
        disable=not (cfg.progress and backend.is_main_process),
        mininterval=PROGRESS_INTERVAL,
        # A count bound too: a long run on a loaded machine sends as few messages as on a fast one.
        # maxinterval=inf: tqdm's monitor thread would otherwise reset miniters to 1 after 10 s.
        miniters=max(1, math.ceil((total_steps - start_step) / PROGRESS_REDRAWS)),
        maxinterval=float("inf"),
    )
    model.train()
    step, watch, tokens, stop = start_step, Stopwatch(backend.device), 0, False
    with local_sgd(backend, model, cfg.local_sgd_steps, start_step) as averager:  # [local_sgd]
        window_loss = 0.0  # what history records per step: the mean loss over the step's window
        for epoch in range(first_epoch, math.ceil(total_steps / per_epoch)):
            set_epoch(train_dataloader, epoch)  # [ddp] else every epoch replays epoch 0's shuffle
            watch.start()
            start = skip if epoch == first_epoch else 0  # [resume] skip the batches trained on already
            for batch, update, window in micro_batches(train_dataloader, k, start):  # [accum]
                batch = backend.to_device(batch)
                tokens += batch.get("input_ids", batch["labels"]).numel()  # images/audio: examples
                with sync_gradients(model, update):  # [ddp] all-reduce only in the window's last backward
                    with backend.autocast():  # [amp]
                        loss = forward(**batch).loss / window  # forward + loss  # [accum] window mean
                    backend.backward(loss)  # backward  # [amp] scaled for fp16
                window_loss += loss.detach()  # each micro-batch's mean / window: their sum is the mean
                if not update:  # [accum]
                    continue
                if cfg.max_grad_norm:
                    # [clip] after the whole window's backward, before the step; unscales first
                    history.grad_norms.append(clip_gradients(backend, model, optimizer, cfg.max_grad_norm))
                backend.step(optimizer, history)  # step  # [amp] skipped on inf/nan
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)  # free the gradients' memory until the next backward
                averager.step()  # [local_sgd] every local_sgd_steps steps: average the parameters

                step += 1
                history.losses.append(float(window_loss))  # note: a CPU-GPU sync point
                window_loss = 0.0
                history.step_times.append(watch.lap())
                history.step_tokens.append(tokens)
                tokens = 0
                bar.set_postfix(loss=f"{history.losses[-1]:.3f}", refresh=False)
                bar.update(1)
                if on_step is not None:
                    stop = bool(on_step(step))  # [resume] e.g. save a checkpoint; True: stop here
                watch.start()  # after on_step: saving a checkpoint is not step time
                if step >= total_steps or stop:
                    break
            if eval_dataloader is not None and cfg.eval_every_epoch:
                history.evals.append(
                    {"step": step, **evaluate(model, eval_dataloader, **backend.eval_args())}
                )
            if step >= total_steps or stop:
                break
    bar.close()
    if not all(math.isfinite(x) for x in history.losses):
        warnings.warn(
            "Some training losses were not finite: lower lr or use bf16/loss scaling.", stacklevel=2
        )
    return history
