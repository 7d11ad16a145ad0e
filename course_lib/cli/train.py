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

About 480 lines because the command's flags, set-up and run read best in one file, top to bottom. Its
training flags are ``TrainConfig``'s fields (``TRAIN_FLAGS``: one declaration, one validation).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import torch

from course_lib import checkpoints, data, models, training
from course_lib.devices import seed_everything
from course_lib.instruments.throughput import format_per_process, per_process_throughput
from course_lib.mixed_precision import best_precision, normalize_precision
from course_lib.training import fsdp
from course_lib.training.accum import steps_per_epoch
from course_lib.training.ddp import COMM_HOOKS

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3  # --stop-after-steps: the run "dies" after a checkpoint, like a killed job


# The training options are ``TrainConfig``'s fields: their types, defaults and checks come from there
# (declared once, validated once in ``TrainConfig.__post_init__``). The command adds only each flag's
# name, group and help. Fields it sets itself: precision (``--precision``, resolved against the
# launcher), device (the launcher and ``--cpu``), compile_dynamic (from ``--padding``).
SET_BY_COMMAND = ("precision", "device", "compile_dynamic")
TECHNIQUES, RECIPE = (
    "techniques (lessons 04-06b)",
    "recipe switches (lesson 07: python -m course_lib.cli.recipe prints a line)",
)
TRAIN_FLAGS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {  # field: (group, help, flags)
    "epochs": (None, "passes over the training rows", ()),
    "max_steps": (None, "optimizer steps (overrides --epochs)", ()),
    "lr": (None, "peak learning rate (linear warm-up, then linear decay)", ()),
    "weight_decay": (None, "AdamW's decoupled weight decay (none on biases and LayerNorm)", ()),
    "warmup_ratio": (None, "share of the steps spent warming up", ()),
    "grad_accum_steps": (None, "micro-batches per optimizer step", ()),
    "max_grad_norm": (None, "clip the gradients' global norm to this ('none': no clipping)", ()),
    "seed": (None, "data order, dropout and the classifier head's initialisation", ()),
    "progress": (None, "no progress bar", ("--no-progress",)),
    "eval_every_epoch": (None, "skip the per-epoch evaluation", ("--no-eval",)),
    "optimizer": (
        TECHNIQUES,
        "AdamW (8 bytes of state per parameter), Adafactor (factored), 8-bit AdamW (bitsandbytes)",
        (),
    ),
    "gradient_checkpointing": (
        TECHNIQUES,
        "recompute activations in backward: less memory, about one extra forward pass",
        (),
    ),
    "local_sgd_steps": (
        TECHNIQUES,
        "N processes: average the parameters every N optimizer steps instead of the gradients every step",
        (),
    ),
    "comm_hook": (
        TECHNIQUES,
        "N processes: all-reduce gradients in 16 bits (bf16 needs NCCL, i.e. GPUs)",
        (),
    ),
    "fsdp": (
        TECHNIQUES,
        "N processes: shard parameters, gradients and AdamW state (FSDP2 fully_shard) instead of DDP",
        (),
    ),
    "fused_optimizer": (
        RECIPE,
        "AdamW's fused kernel (auto: where torch has it; no: torch's default kernel, foreach on GPUs and the for-loop on CPUs)",
        ("--fused-adamw",),
    ),
    "attn_implementation": (RECIPE, "attention kernels (default: as the model loads)", ()),
    "compile": (RECIPE, "torch.compile the model for training (compilation counts in the run's time)", ()),
}
CHOICES = {
    "optimizer": training.OPTIMIZERS,
    "comm_hook": COMM_HOOKS,
    "attn_implementation": training.ATTENTION,
}
TRI_STATE = {"auto": None, "yes": True, "no": False}  # a bool | None field's flag values


@dataclass
class RunConfig:
    """Everything one run of the command is told: its own settings, and the loop's ``TrainConfig``."""

    model: str | None = None  # None: the COURSE_MODEL switch (embedded by default)
    dataset: str | None = None  # None: the COURSE_DATASET switch; "embedded" or "hub"
    precision: str | None = None  # "no" | "bf16" | "fp16" | "auto"; None: the launcher's setting, else "no"
    batch_size: int = 16  # per process: the global batch is batch_size x processes x grad_accum_steps
    train_rows: int | None = None  # first N training rows; None: all
    eval_rows: int | None = None  # first N validation rows; None: all
    max_length: int = 128
    output_dir: str = "runs/train"
    save_every: int = 100  # optimizer steps between checkpoints (and always at the end)
    keep_checkpoints: int = 2
    resume: str | None = None  # "latest" (in output_dir) or a checkpoint folder
    stop_after_steps: int | None = None  # simulate a crash after this step (tests, lessons)
    cpu: bool = False
    padding: str = "dynamic"  # "dynamic" (each batch to its longest row) | "max_length" (all to max_length)
    pad_multiple: int | None = (
        None  # dynamic padding rounded up to a multiple of this; None: 8 under fp16/bf16
    )
    group_by_length: bool = False  # batches of similar lengths (one process)
    train: training.TrainConfig = field(default_factory=training.TrainConfig)  # the loop's settings

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        for name in ("train_rows", "eval_rows", "stop_after_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or left out), got {value}.")
        local_sgd_steps = self.train.local_sgd_steps
        if local_sgd_steps and self.save_every % local_sgd_steps:
            raise ValueError(
                f"--save-every {self.save_every} is not a multiple of --local-sgd-steps {local_sgd_steps}: "
                "a checkpoint must hold the averaged parameters. Pick --save-every as a multiple of it."
            )
        if self.precision not in (None, "auto"):
            self.precision = normalize_precision(self.precision)
        if self.padding not in ("dynamic", "max_length"):
            raise ValueError(f"--padding must be 'dynamic' or 'max_length', got {self.padding!r}.")
        if self.pad_multiple is not None and (self.pad_multiple < 1 or self.padding != "dynamic"):
            raise ValueError("--pad-multiple needs --padding dynamic and a value >= 1.")

    def as_dict(self) -> dict[str, Any]:
        """The command's settings and the loop's, in one flat dict (``metrics.json``, checkpoints)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}
        return {**own, **asdict(self.train)}


def _flag(name: str) -> str:
    """The flag a ``TrainConfig`` field is set by (the first of its flags)."""
    return (TRAIN_FLAGS[name][2] or (f"--{name.replace('_', '-')}",))[0]


def _flags_in(message: str) -> str:
    """A ``TrainConfig`` error message in the command's words: each field name as its flag."""
    for name in sorted(TRAIN_FLAGS, key=len, reverse=True):
        # longest first, and not inside a word, a dotted name or a flag already written (--max-steps)
        message = re.sub(rf"(?<![\w.-]){name}(?!\w)", _flag(name), message)
    return message


def _or_none(kind):
    """An argparse type for an ``X | None`` field: a number, or 'none'."""

    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _add_train_options(parser: argparse.ArgumentParser) -> dict[str | None, Any]:
    """One flag per ``TRAIN_FLAGS`` field, its type, default and choices read from ``TrainConfig``;
    returns the argument groups by title."""
    hints, defaults = get_type_hints(training.TrainConfig), training.TrainConfig()
    groups: dict[str | None, Any] = {None: parser}
    for name, (group, help_text, flags) in TRAIN_FLAGS.items():
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        kind, default = hints[name], getattr(defaults, name)
        flags = flags or (f"--{name.replace('_', '-')}",)
        add = groups[group].add_argument
        if kind is bool:
            # a field that defaults to True gets a --no-... flag that stores False
            add(*flags, dest=name, action="store_false" if default else "store_true", help=help_text)
        elif kind == bool | None:  # auto / yes / no
            add(*flags, dest=name, default="auto", choices=list(TRI_STATE), help=help_text)
        else:
            base = next(t for t in get_args(kind) or (kind,) if t is not type(None))
            choices = list(CHOICES[name]) if name in CHOICES else None
            # 'none' only where it is not the default (--max-grad-norm none); a None default: leave it out
            parse = base if choices or base is str or default is None else _or_none(base)
            add(*flags, dest=name, type=parse, default=default, choices=choices, help=help_text)
    return groups


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
    p.add_argument(
        "--train-rows", type=int, default=d.train_rows, help="first N training rows (default: all)"
    )
    p.add_argument(
        "--eval-rows", type=int, default=d.eval_rows, help="first N validation rows (default: all)"
    )
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per sentence pair")
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
    recipe = _add_train_options(p)[RECIPE]
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
    args = vars(p.parse_args(argv))
    train_args = {name: args.pop(name) for name in TRAIN_FLAGS}  # what is left: RunConfig's own fields
    if "fused_optimizer" in train_args:
        train_args["fused_optimizer"] = TRI_STATE[train_args["fused_optimizer"]]
    try:
        return RunConfig(**args, train=training.TrainConfig(**train_args))
    except ValueError as err:
        p.error(_flags_in(str(err)))  # exits with status 2
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
        torch.set_num_threads(max(1, cores // local_processes))  # more threads than cores: they spin and wait
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
        seed=cfg.train.seed,
        pad_to=cfg.max_length if cfg.padding == "max_length" else None,
        pad_multiple=cfg.pad_multiple,
        group_by_length=cfg.group_by_length,
        world_size=accelerator.num_processes,
        rank=accelerator.process_index,
        device=accelerator.device,
    )
    eval_loader = data.make_dataloader(val_split, tokenizer, 2 * cfg.batch_size, precision=precision)
    eval_loader.generator = torch.Generator().manual_seed(cfg.train.seed)  # keep the global RNG untouched
    return train_loader, eval_loader


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run makes in all (what ``training.train`` computes)."""
    t = cfg.train
    return t.max_steps or steps_per_epoch(batches_per_epoch, t.grad_accum_steps) * t.epochs


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
    seed_everything(cfg.train.seed)
    with accelerator.main_process_first():  # a hub download happens once
        tokenizer, train_split, val_split = load_splits(cfg)
        model = models.load_model(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    train_loader, eval_loader = make_loaders(cfg, accelerator, tokenizer, train_split, val_split)
    if cfg.train.fsdp or fsdp.accelerator_shards(accelerator):  # before the optimizer: it holds the shards
        fsdp.shard_model(model.to(accelerator.device))
    held = gather_object([fsdp.local_numel(model)])  # parameters each rank holds (collective)
    log(f"parameters: {n_params}, held per process: {held}")
    t = cfg.train
    optimizer = training.make_optimizer(
        model, t.lr, t.weight_decay, fused=t.fused_optimizer, name=t.optimizer
    )
    steps = total_steps(cfg, len(train_loader))

    start_step = 0
    resume_from = checkpoints.find_resume_checkpoint(cfg.resume, cfg.output_dir)
    if resume_from is not None:
        start_step = checkpoints.load_checkpoint(resume_from, model, optimizer, accelerator)
        log(f"resumed from {resume_from} at step {start_step}")
    global_batch = cfg.batch_size * t.grad_accum_steps * accelerator.num_processes
    log(
        f"batch {cfg.batch_size} per process x {t.grad_accum_steps} accumulation x "
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
                cfg.as_dict(),
                cfg.keep_checkpoints,
                per_rank_optimizer=bool(t.local_sgd_steps),  # each rank's own state under local SGD
            )
            log(f"step {step}: checkpoint {path}")
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps and step < steps:
            log(f"--stop-after-steps {cfg.stop_after_steps}: exiting at step {step} as if killed")
            sys.stdout.flush()
            os._exit(EXIT_STOPPED)  # no clean-up at all, like SIGKILL

    train_cfg = replace(  # the loop's settings, with what the command decided
        t,
        precision=accelerator.mixed_precision,
        compile_dynamic=True if t.compile and cfg.padding == "dynamic" else None,  # lengths vary per batch
    )
    started = time.perf_counter()
    history = training.train(
        model,
        train_loader,
        train_cfg,
        eval_dataloader=eval_loader if t.eval_every_epoch else None,
        accelerator=accelerator,
        optimizer=optimizer,
        start_step=start_step,
        on_step=on_step,
    )
    wall_s = time.perf_counter() - started
    tp = per_process_throughput(history, cfg.batch_size * t.grad_accum_steps, accelerator)
    final = checkpoints.save_final_model(cfg.output_dir, model, tokenizer, accelerator)
    metrics = {
        "config": cfg.as_dict(),
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
