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

Its flags are in ``course_lib.cli.train_options`` (``TrainConfig``'s fields: one declaration, one
validation). What the loop decides (FSDP sharding before the optimizer, the run's number of steps) is
decided in ``course_lib.training`` only: this command calls the same functions.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from course_lib import checkpoints, data, distributed, models, training
from course_lib.cli.train_options import SET_BY_COMMAND, TRAIN_FLAGS, RunConfig, parse_args
from course_lib.devices import seed_everything
from course_lib.instruments.throughput import format_per_process, per_process_throughput
from course_lib.mixed_precision import best_precision, normalize_precision
from course_lib.training import fsdp
from course_lib.training.accum import run_steps

__all__ = ["SET_BY_COMMAND", "TRAIN_FLAGS", "RunConfig", "main", "parse_args", "run"]

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3  # --stop-after-steps: the run "dies" after a checkpoint, like a killed job


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


def check_launch(env: dict[str, str] | None = None) -> None:
    """Refuse a torchrun launch whose nodes disagree, before any process group forms.

    torchrun joins whatever its nodes bring: one node started with ``--nproc-per-node 2`` beside one with
    1 makes a group of 3 (measured, torch 2.13), with another global batch and another epoch length
    than either command says. Every node must run the same number of processes; a rank must be below
    the world size."""
    env = os.environ if env is None else env
    if "GROUP_WORLD_SIZE" not in env:  # not a torchrun (or accelerate launch) worker
        return
    world, local, nodes = (int(env[k]) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"))
    rank, node = int(env.get("RANK", "0")), int(env.get("GROUP_RANK", "0"))
    if world != local * nodes:
        raise ValueError(
            f"the nodes run different numbers of processes: {world} in all over {nodes} node(s), {local} on "
            f"this one (node rank {node}). Start every node with the same --nproc-per-node (accelerate "
            "launch: the same --num_processes and --num_machines on every machine)."
        )
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}: --node-rank must be 0..--nnodes - 1.")


def make_accelerator(cfg: RunConfig):
    """An ``Accelerator`` for this run: it joins whatever process group the launcher set up.

    ``step_scheduler_with_optimizer=False``: the loop already counts steps per process, so the
    scheduler must advance once per optimizer step (Accelerate's default advances it once per process).
    """
    from accelerate import Accelerator

    check_launch()
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # what torchrun / accelerate launch started
    # Without CUDA, Accelerate joins a multi-process launch only when told cpu=True (MULTI_CPU, gloo).
    cpu = cfg.cpu or (launched > 1 and not torch.cuda.is_available())
    precision = resolve_precision(cfg.precision, cpu)
    if launched > 1:  # torchrun: each attempt of a restarted group keeps to its own keys
        distributed.join_elastic_group("nccl" if torch.cuda.is_available() and not cpu else "gloo")
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
    t = cfg.train
    optimizer = training.build_optimizer(model, t, accelerator)  # shards the model first under --fsdp
    held = gather_object([fsdp.local_numel(model)])  # parameters each rank holds (collective)
    log(f"parameters: {n_params}, held per process: {held}")
    steps = run_steps(len(train_loader), t.grad_accum_steps, t.epochs, t.max_steps)  # as the loop counts

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

    # torchrun --max-restarts N numbers each attempt of the worker group (0: the first). Each node's agent
    # counts its own: under several c10d agents, a node whose worker did not fail may restart at 0.
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stopping = (  # --stop-after-steps simulates one crash: a restarted or resumed run goes to the end
        cfg.stop_after_steps is not None
        and restarts == 0
        and start_step == 0
        and cfg.stop_rank in (None, accelerator.process_index)
    )

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
        if stopping and step >= cfg.stop_after_steps and step < steps:
            print(  # from the rank that dies (log() prints on the main process only)
                f"--stop-after-steps {cfg.stop_after_steps}: rank {accelerator.process_index} exiting at "
                f"step {step} as if killed",
                flush=True,
            )
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
        "restarts": restarts,
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
