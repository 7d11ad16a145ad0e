"""Fine-tune the course model on the course data, on one device or many: ``python -m course_lib.cli.train``.

The same command runs unchanged under every launcher, because an ``Accelerator`` reads what the
launcher sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and wraps the model in DDP::

    python -m course_lib.cli.train --max-steps 50                                    # 1 process: CPU or 1 GPU
    torchrun --standalone --nproc_per_node 2 -m course_lib.cli.train --max-steps 50  # gloo on CPU, nccl on GPUs
    accelerate launch --multi_gpu --num_processes 8 -m course_lib.cli.train ...     # + --num_machines ...
    notebook_launcher(course_lib.cli.train.main, args=(["--max-steps", "8"],), num_processes=2)

It trains with the course's one loop (``course_lib.training.train``); this file adds the data sharding
(``course_lib.distributed.ShardedLoader``), checkpoints (``course_lib.checkpoints``), ``--resume``, and
a throughput report per process and in total. See ``docs/distributed.md``.

About 440 lines because the command's flags, set-up and run read best in one file, top to bottom.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from course_lib import checkpoints, data, models, training
from course_lib.devices import seed_everything
from course_lib.instruments.throughput import format_per_process, per_process_throughput
from course_lib.mixed_precision import best_precision, normalize_precision
from course_lib.training import fsdp
from course_lib.training.ddp import COMM_HOOKS

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3  # --stop-after-steps: the run "dies" after a checkpoint, like a killed job


@dataclass
class RunConfig:
    """Everything one run of the command is told (logged with ``asdict`` into ``metrics.json``)."""

    model: str | None = None  # None: the COURSE_MODEL switch (embedded by default)
    dataset: str | None = None  # None: the COURSE_DATASET switch; "embedded" or "hub"
    precision: str | None = None  # "no" | "bf16" | "fp16" | "auto"; None: the launcher's setting, else "no"
    batch_size: int = 16  # per process: the global batch is batch_size x processes x grad_accum_steps
    grad_accum_steps: int = 1
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: all epochs
    lr: float = 5e-4
    max_grad_norm: float | None = 1.0
    seed: int = 0
    train_rows: int | None = None  # first N training rows; None: all
    eval_rows: int | None = None  # first N validation rows; None: all
    max_length: int = 128
    evaluate: bool = True
    output_dir: str = "runs/train"
    save_every: int = 100  # optimizer steps between checkpoints (and always at the end)
    keep_checkpoints: int = 2
    resume: str | None = None  # "latest" (in output_dir) or a checkpoint folder
    stop_after_steps: int | None = None  # simulate a crash after this step (tests, demos)
    cpu: bool = False
    progress: bool = True
    optimizer: str = "adamw"  # "adamw" | "adafactor" | "adamw8bit"
    gradient_checkpointing: bool = False
    local_sgd_steps: int | None = None  # average parameters every N steps instead of gradients every step
    comm_hook: str = "none"  # "none" | "fp16" | "bf16" (NCCL only): 16-bit gradients on the wire
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the processes (FSDP2)
    padding: str = (
        "dynamic"  # "dynamic" (each batch to its longest row) | "max_length" (every batch to max_length)
    )
    pad_multiple: int | None = (
        None  # dynamic padding rounded up to a multiple of this; None: 8 under fp16/bf16
    )
    group_by_length: bool = False  # batches of similar lengths (one process)
    fused_adamw: str = "auto"  # "auto" (fused where torch has the kernel) | "yes" | "no"
    attn_implementation: str | None = None  # "eager" | "sdpa"; None: as the model loads
    compile: bool = False  # torch.compile the model (compilation counts in the run's time)

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "grad_accum_steps",
            "epochs",
            "max_length",
            "save_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        for name in ("max_steps", "train_rows", "eval_rows", "stop_after_steps", "local_sgd_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or left out), got {value}.")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}.")
        if self.local_sgd_steps and self.save_every % self.local_sgd_steps:
            raise ValueError(
                f"--save-every {self.save_every} is not a multiple of --local-sgd-steps {self.local_sgd_steps}: "
                "a checkpoint must hold the averaged parameters. Pick --save-every as a multiple of it."
            )
        if self.local_sgd_steps and self.comm_hook != "none":
            raise ValueError(
                "--comm-hook compresses DDP's per-step gradient all-reduce, which --local-sgd-steps turns "
                "off (it averages parameters instead): use one of the two."
            )
        if self.precision not in (None, "auto"):
            self.precision = normalize_precision(self.precision)
        if self.padding not in ("dynamic", "max_length"):
            raise ValueError(f"--padding must be 'dynamic' or 'max_length', got {self.padding!r}.")
        if self.pad_multiple is not None and (self.pad_multiple < 1 or self.padding != "dynamic"):
            raise ValueError("--pad-multiple needs --padding dynamic and a value >= 1.")
        if self.fused_adamw not in ("auto", "yes", "no"):
            raise ValueError(f"--fused-adamw must be auto, yes or no, got {self.fused_adamw!r}.")
        if self.fused_adamw != "auto" and self.optimizer != "adamw":
            raise ValueError("--fused-adamw applies to --optimizer adamw only.")


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The command line as a ``RunConfig`` (bad values exit with status 2 and say what to do)."""
    d = RunConfig()
    p = argparse.ArgumentParser(
        prog="python -m course_lib.cli.train",
        description="Fine-tune the course model with the course's training loop, on 1 or N processes.",
    )
    p.add_argument("--model", default=d.model, help="hub id or folder (default: COURSE_MODEL / embedded)")
    p.add_argument(
        "--dataset", default=d.dataset, choices=["embedded", "hub"], help="default: COURSE_DATASET"
    )
    p.add_argument(
        "--precision",
        default=d.precision,
        help="no (fp32), bf16, fp16 (GPU only) or auto (default: accelerate launch's --mixed_precision, else no)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    p.add_argument("--grad-accum-steps", type=int, default=d.grad_accum_steps)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--max-grad-norm", type=float, default=d.max_grad_norm, help="clip the gradients' global norm"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--train-rows", type=int, default=d.train_rows, help="first N training rows (default: all)"
    )
    p.add_argument(
        "--eval-rows", type=int, default=d.eval_rows, help="first N validation rows (default: all)"
    )
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per sentence pair")
    p.add_argument("--no-eval", dest="evaluate", action="store_false", help="skip the per-epoch evaluation")
    p.add_argument("--output-dir", default=d.output_dir, help="checkpoints, final model, metrics.json")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N optimizer steps")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="newest N are kept")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from a checkpoint folder, or the newest one in --output-dir (no value / 'latest')",
    )
    p.add_argument("--stop-after-steps", type=int, default=None, help="exit with status 3 after step N")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs are present")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    techniques = p.add_argument_group("techniques (lessons 04-06)")
    techniques.add_argument(
        "--optimizer",
        default=d.optimizer,
        choices=list(training.OPTIMIZERS),
        help="AdamW (8 bytes of state per parameter), Adafactor (factored), 8-bit AdamW (bitsandbytes)",
    )
    techniques.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward: less memory, about one extra forward pass",
    )
    techniques.add_argument(
        "--local-sgd-steps",
        type=int,
        default=d.local_sgd_steps,
        help="N processes: average the parameters every N optimizer steps instead of the gradients every step",
    )
    techniques.add_argument(
        "--comm-hook",
        default=d.comm_hook,
        choices=list(COMM_HOOKS),
        help="N processes: all-reduce gradients in 16 bits (bf16 needs NCCL, i.e. GPUs)",
    )
    techniques.add_argument(
        "--fsdp",
        action="store_true",
        help="N processes: shard parameters, gradients and AdamW state (FSDP2 fully_shard) instead of DDP",
    )
    recipe = p.add_argument_group(
        "recipe switches (lesson 07: python -m course_lib.cli.recipe prints a line)"
    )
    recipe.add_argument(
        "--padding",
        default=d.padding,
        choices=["dynamic", "max_length"],
        help="dynamic: each batch to its longest row; max_length: every batch to --max-length (the slides)",
    )
    recipe.add_argument(
        "--pad-multiple", type=int, default=d.pad_multiple, help="round dynamic padding up to a multiple of N"
    )
    recipe.add_argument(
        "--group-by-length", action="store_true", help="batches of similar lengths (one process only)"
    )
    recipe.add_argument(
        "--fused-adamw",
        default=d.fused_adamw,
        choices=["auto", "yes", "no"],
        help="AdamW's fused kernel (auto: where torch has it; no: the default for-loop kernel)",
    )
    recipe.add_argument(
        "--attn-implementation", default=d.attn_implementation, choices=list(training.ATTENTION)
    )
    recipe.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    args = p.parse_args(argv)
    try:
        return RunConfig(**vars(args))
    except ValueError as err:
        p.error(str(err))  # exits with status 2
        raise  # unreachable


# ---------------------------------------------------------------------------------------------
# Set-up: the Accelerator, threads, data
# ---------------------------------------------------------------------------------------------


def resolve_precision(precision: str | None, cpu: bool) -> str:
    """``auto`` -> the device's best precision, ``None`` -> the launcher's; refuse fp16 on a CPU."""
    on_cpu = cpu or not torch.cuda.is_available()
    if precision is None:  # `accelerate launch --mixed_precision X` sets this variable
        precision = normalize_precision(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if precision == "auto":
        return best_precision("cpu" if on_cpu else "cuda")
    if precision == "fp16" and on_cpu:
        raise ValueError(
            "--precision fp16 on a CPU: Accelerate silently trains in fp32 there, and fp16 matmuls are "
            "far slower than fp32 on CPUs. Use --precision bf16 (the CPU's mixed precision) or no."
        )
    return precision


def make_accelerator(cfg: RunConfig):
    """An ``Accelerator`` for this run: it joins whatever process group the launcher set up.

    ``step_scheduler_with_optimizer=False``: the loop already counts steps per process, so the
    scheduler must advance once per optimizer step (Accelerate's default advances it once per process).
    """
    from accelerate import Accelerator

    launched = int(os.environ.get("WORLD_SIZE", "1"))  # what torchrun / accelerate launch started
    # Without CUDA, Accelerate joins a multi-process launch only when told cpu=True (MULTI_CPU, gloo).
    cpu = cfg.cpu or (launched > 1 and not torch.cuda.is_available())
    precision = resolve_precision(cfg.precision, cpu)
    accelerator = Accelerator(cpu=cpu, mixed_precision=precision, step_scheduler_with_optimizer=False)
    if accelerator.num_processes != launched:
        raise RuntimeError(
            f"The launcher started {launched} processes but the Accelerator sees {accelerator.num_processes}: "
            "each would train alone on the same output folder. Pass --cpu to train on CPUs, or check the "
            "launcher's settings (accelerate config)."
        )
    return accelerator


def set_cpu_threads() -> int:
    """Share the CPU cores among this machine's processes (unless ``OMP_NUM_THREADS`` says otherwise)."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, cores // local_processes))
    return torch.get_num_threads()


def load_splits(cfg: RunConfig):
    """Tokenizer and the tokenised train / validation rows this run uses."""
    tokenizer = models.load_tokenizer(cfg.model)
    raw = data.load_mrpc(cfg.dataset)
    train = data.tokenize_dataset(data.first_rows(raw["train"], cfg.train_rows), tokenizer, cfg.max_length)
    val = data.tokenize_dataset(data.first_rows(raw["validation"], cfg.eval_rows), tokenizer, cfg.max_length)
    return tokenizer, train, val


def make_loaders(cfg: RunConfig, accelerator, tokenizer, train_split, val_split):
    """This rank's shard of the training rows, and the validation DataLoader (sharded by ``prepare``)."""
    precision = accelerator.mixed_precision
    train_loader = data.make_train_loader(
        train_split,
        tokenizer,
        cfg.batch_size,
        precision=precision,
        seed=cfg.seed,
        pad_to=cfg.max_length if cfg.padding == "max_length" else None,
        pad_multiple=cfg.pad_multiple,
        group_by_length=cfg.group_by_length,
        world_size=accelerator.num_processes,
        rank=accelerator.process_index,
        device=accelerator.device,
    )
    eval_loader = data.make_dataloader(val_split, tokenizer, 2 * cfg.batch_size, precision=precision)
    eval_loader.generator = torch.Generator().manual_seed(cfg.seed)  # keep the global RNG untouched
    return train_loader, eval_loader


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run makes in all (what ``training.train`` computes)."""
    return cfg.max_steps or math.ceil(batches_per_epoch / cfg.grad_accum_steps) * cfg.epochs


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train per ``cfg`` in this process (one rank of however many the launcher started)."""
    from accelerate.utils import gather_object

    accelerator = make_accelerator(cfg)
    threads = set_cpu_threads() if accelerator.device.type == "cpu" else torch.get_num_threads()
    log = accelerator.print  # the main process only
    state = accelerator.state
    log(
        f"course_lib.cli.train: {accelerator.num_processes} process(es), {state.distributed_type.value}"
        f"{' (' + state.backend + ')' if state.backend else ''}, device {accelerator.device.type}, "
        f"precision {accelerator.mixed_precision}, {threads} torch thread(s) per process"
    )
    seed_everything(cfg.seed)
    with accelerator.main_process_first():  # a hub download happens once
        tokenizer, train_split, val_split = load_splits(cfg)
        model = models.load_model(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    train_loader, eval_loader = make_loaders(cfg, accelerator, tokenizer, train_split, val_split)
    if cfg.fsdp or fsdp.accelerator_shards(accelerator):  # before the optimizer: it holds the shards
        fsdp.shard_model(model.to(accelerator.device))
    held = gather_object([fsdp.local_numel(model)])  # parameters each rank holds (collective)
    log(f"parameters: {n_params}, held per process: {held}")
    fused = {"auto": None, "yes": True, "no": False}[cfg.fused_adamw]
    optimizer = training.make_optimizer(model, cfg.lr, weight_decay=0.01, fused=fused, name=cfg.optimizer)
    steps = total_steps(cfg, len(train_loader))

    start_step = 0
    resume_from = checkpoints.find_resume_checkpoint(cfg.resume, cfg.output_dir)
    if resume_from is not None:
        start_step = checkpoints.load_checkpoint(resume_from, model, optimizer, accelerator)
        log(f"resumed from {resume_from} at step {start_step}")
    global_batch = cfg.batch_size * cfg.grad_accum_steps * accelerator.num_processes
    log(
        f"batch {cfg.batch_size} per process x {cfg.grad_accum_steps} accumulation x "
        f"{accelerator.num_processes} process(es) = {global_batch} rows per step; "
        f"{len(train_split)} training rows, {len(train_loader)} batches per process per epoch; "
        f"steps {start_step + 1}..{steps}"
    )
    if start_step >= steps:
        log(f"nothing to do: the checkpoint is at step {start_step} of {steps}.")
        accelerator.end_training()
        return {"steps_run": 0, "start_step": start_step}

    def on_step(step: int) -> None:
        if step % cfg.save_every == 0 or step == steps:
            path = checkpoints.save_checkpoint(
                cfg.output_dir,
                step,
                model,
                optimizer,
                accelerator,
                asdict(cfg),
                cfg.keep_checkpoints,
                per_rank_optimizer=bool(cfg.local_sgd_steps),  # each rank's own state under local SGD
            )
            log(f"step {step}: checkpoint {path}")
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps and step < steps:
            log(f"--stop-after-steps {cfg.stop_after_steps}: exiting at step {step} as if killed")
            sys.stdout.flush()
            os._exit(EXIT_STOPPED)  # no clean-up at all, like SIGKILL

    train_cfg = training.TrainConfig(
        epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        lr=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,
        precision=accelerator.mixed_precision,
        grad_accum_steps=cfg.grad_accum_steps,
        seed=cfg.seed,
        progress=cfg.progress,
        eval_every_epoch=cfg.evaluate,
        optimizer=cfg.optimizer,
        gradient_checkpointing=cfg.gradient_checkpointing,
        local_sgd_steps=cfg.local_sgd_steps,
        comm_hook=cfg.comm_hook,
        attn_implementation=cfg.attn_implementation,
        compile=cfg.compile,
        fsdp=cfg.fsdp,
        compile_dynamic=True if cfg.compile and cfg.padding == "dynamic" else None,
    )
    started = time.perf_counter()
    history = training.train(
        model,
        train_loader,
        train_cfg,
        eval_dataloader=eval_loader if cfg.evaluate else None,
        accelerator=accelerator,
        optimizer=optimizer,
        start_step=start_step,
        on_step=on_step,
    )
    wall_s = time.perf_counter() - started
    tp = per_process_throughput(history, cfg.batch_size * cfg.grad_accum_steps, accelerator)
    final = checkpoints.save_final_model(cfg.output_dir, model, tokenizer, accelerator)
    metrics = {
        "config": asdict(cfg),
        "processes": accelerator.num_processes,
        "distributed_type": state.distributed_type.value,
        "backend": state.backend,
        "device": accelerator.device.type,
        "precision": accelerator.mixed_precision,
        "threads_per_process": threads,
        "parameters": n_params,
        "parameters_per_process": held,
        "global_batch": global_batch,
        "start_step": start_step,
        "steps_run": len(history.losses),
        "wall_s": wall_s,
        "losses": history.losses,
        "grad_norms": history.grad_norms,
        "evals": history.evals,
        **tp,
    }
    if accelerator.is_main_process:
        (Path(cfg.output_dir) / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(
        f"final loss {history.losses[-1]:.4f}"
        + (f", validation {history.evals[-1]}" if history.evals else "")
    )
    log(
        "throughput (padded tokens and samples per second, median over optimizer steps):\n"
        + format_per_process(tp)
    )
    log(f"final model: {final}; metrics: {Path(cfg.output_dir) / 'metrics.json'}")
    accelerator.end_training()
    return metrics


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m course_lib.cli.train`` (and of ``notebook_launcher(main, args=(argv,))``)."""
    cfg = parse_args(argv)
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, ConnectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
