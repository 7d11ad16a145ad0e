"""Lesson 02's demonstrations: sharding, replication, gradient aggregation and parameter sync, recorded.

Each worker runs on every rank of ``course_lib.distributed.launch`` and returns what the rank holds
at each stage, so the notebook can show it. They live in a module (not in the notebook) because
spawned processes can only run importable functions. ``sharding_worker`` reads a shard;
``ddp_step_worker`` takes one DDP step by hand (the lesson shows it line for line; ``local_batch`` and
``StageRecord`` are its data and its recorder); ``accelerate_worker`` does the same replication with
``accelerator.prepare(model)`` and evaluates with ``gather`` and ``gather_for_metrics``;
``step_and_eval_worker`` runs the last two in one launch (one process start instead of two).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from course_lib import data, models
from course_lib.devices import to_device
from course_lib.distributed import (
    ShardedLoader,
    disable_dropout,
    flat_grads,
    flat_params,
    param_slices,
    rank_device,
    same_on_all_ranks,
    shard_indices,
)


@dataclass
class StepDemo:
    """One SGD step on ``global_batch`` training rows, shared out over the ranks."""

    global_batch: int = 8
    lr: float = 0.5
    seed: int = 0
    model: str | None = None  # None: the COURSE_MODEL switch (embedded by default)

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")


def demo_rows(rows: int, model: str | None = None):
    """The first ``rows`` tokenised training rows and their tokenizer (the course data and model)."""
    tokenizer = models.load_tokenizer(model)
    split = data.load_mrpc()["train"].select(range(rows))
    return data.tokenize_dataset(split, tokenizer), tokenizer


def sharding_worker(rank: int, world_size: int, rows: int, batch_size: int, seed: int = 0) -> dict:
    """Which dataset rows this rank's ``ShardedLoader`` reads in epoch 0 (row indices per batch)."""
    tokenized, tokenizer = demo_rows(rows)
    loader = ShardedLoader(
        tokenized, batch_size, data.make_collator(tokenizer), world_size, rank, shuffle=True, seed=seed
    )
    loader.sampler.set_epoch(0)
    shapes = [tuple(batch["input_ids"].shape) for batch in loader]  # the batches really are read
    return {"rank": rank, "batches": loader.batch_indices(), "shapes": shapes}


def _sgd_step(model: torch.nn.Module, lr: float) -> None:
    """``p -= lr * p.grad`` for every parameter (plain SGD, so the update is easy to check)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def local_batch(
    global_batch: int, rank: int, world_size: int, device: torch.device, model: str | None = None
) -> tuple[list[int], dict]:
    """Data sharding: this rank's rows of the first ``global_batch`` training rows, collated on ``device``."""
    tokenized, tokenizer = demo_rows(global_batch, model)
    rows = shard_indices(global_batch, world_size, rank)
    return rows, to_device(data.make_collator(tokenizer)([tokenized[i] for i in rows]), device)


class StageRecord:
    """What one rank holds at each stage of a step: flat fp32 CPU copies of its parameters or gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.held: dict[str, torch.Tensor] = {}

    def params(self, stage: str) -> None:
        """Record the parameters as ``params_<stage>``."""
        self.held[f"params_{stage}"] = flat_params(self.model)

    def grads(self, stage: str) -> None:
        """Record the gradients as ``grad_<stage>``."""
        self.held[f"grad_{stage}"] = flat_grads(self.model)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.held[key]

    def result(self, **extra) -> dict:
        """Everything recorded, ``extra``, whether ``params_after`` is the same on every rank, the slices."""
        return {
            **self.held,
            **extra,
            "same_params_all_ranks": same_on_all_ranks(self.held["params_after"]),
            "slices": {k: (s.start, s.stop) for k, s in param_slices(self.model).items()},
        }


def ddp_step_worker(rank: int, world_size: int, demo: StepDemo) -> dict:
    """One data-parallel step on this rank; ``held`` records what the rank holds at each stage."""
    device = rank_device(rank)
    torch.manual_seed(demo.seed + rank)  # a different seed on each rank, on purpose: DDP must fix that
    model = disable_dropout(models.load_model(demo.model)).to(device)  # no dropout: repeatable gradients
    held = StageRecord(model)
    held.params("own_init")
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers to every rank
    held.params("start")
    rows, batch = local_batch(demo.global_batch, rank, world_size, device, demo.model)  # this rank's rows

    with ddp.no_sync():  # replication: forward and backward on this rank's rows, no communication
        loss = ddp(**batch).loss
        loss.backward()
    held.grads("local")

    for p in model.parameters():  # gradient aggregation by hand: sum over the ranks, then divide
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
        p.grad /= world_size
    held.grads("averaged")

    model.zero_grad(set_to_none=True)  # else DDP's backward would add onto the averaged gradients
    ddp(**batch).loss.backward()  # the same, done by DDP: a plain backward all-reduces in buckets
    held.grads("ddp")

    with torch.no_grad():  # parameter sync, DDP style: every rank applies the same averaged gradient
        for p in model.parameters():
            p -= demo.lr * p.grad  # plain SGD, so the update is easy to check
    held.params("after")

    # Parameter sync as on the slide: rank 0 sums the local gradients, updates, shares the parameters.
    grad_sum = held["grad_local"].clone().to(device)  # reduce overwrites it; nccl needs it on the GPU
    dist.reduce(grad_sum, dst=0, op=dist.ReduceOp.SUM)
    shared = held["params_start"].clone().to(device)
    if rank == 0:  # only rank 0's reduced sum is complete; the broadcast overwrites the others
        shared -= demo.lr * grad_sum / world_size
    dist.broadcast(shared, src=0)
    return held.result(rank=rank, rows=rows, loss=loss.item(), params_after_rank0_update=shared.cpu())


@dataclass
class EvalDemo:
    """Evaluation on the first ``rows`` validation rows, ``batch_size`` rows per process and batch.

    Choose ``rows`` so that it does not fill the last round of batches evenly: Accelerate then pads the
    last batch with rows from the start, and ``gather`` returns those duplicates.
    """

    rows: int = 13
    batch_size: int = 4
    seed: int = 0
    model: str | None = None

    def __post_init__(self) -> None:
        if self.rows < 1 or self.batch_size < 1:
            raise ValueError(f"rows and batch_size must be >= 1, got {self.rows} and {self.batch_size}.")


def eval_loader(demo: EvalDemo):
    """A plain DataLoader over the first ``demo.rows`` validation rows, in order (not yet prepared)."""
    tokenizer = models.load_tokenizer(demo.model)
    split = data.load_mrpc()["validation"].select(range(demo.rows))
    tokenized = data.tokenize_dataset(split, tokenizer)
    return DataLoader(tokenized, batch_size=demo.batch_size, collate_fn=data.make_collator(tokenizer))


def gather_predictions(model, loader, accelerator) -> dict[str, torch.Tensor]:
    """Every process's predictions and labels, with ``gather`` and with ``gather_for_metrics``."""
    model.eval()  # dropout off
    gathered, for_metrics = [], []
    with torch.no_grad():  # no graph: evaluation needs no gradients
        for batch in loader:
            preds = model(**batch).logits.argmax(dim=-1)
            gathered.append(accelerator.gather((preds, batch["labels"])))  # keeps the padding rows
            for_metrics.append(accelerator.gather_for_metrics((preds, batch["labels"])))  # drops them
    model.train()
    return {
        "gather_preds": torch.cat([p for p, _ in gathered]).cpu(),
        "gather_labels": torch.cat([y for _, y in gathered]).cpu(),
        "metrics_preds": torch.cat([p for p, _ in for_metrics]).cpu(),
        "metrics_labels": torch.cat([y for _, y in for_metrics]).cpu(),
    }


def accelerate_worker(rank: int, world_size: int, demo: EvalDemo) -> dict:
    """The slide's ``model = accelerator.prepare(model)`` on this rank, then an evaluation with gathering."""
    from accelerate import Accelerator

    # Accelerate resets the thread count of CPU processes unless OMP_NUM_THREADS says it: keep the launch's.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    # cpu=True on a CPU rank: without it (the slide's Accelerator()) a process with no GPU gets
    # DistributedType.NO, and prepare returns the model unwrapped: the ranks would train unrelated replicas.
    accelerator = Accelerator(cpu=rank_device(rank).type == "cpu")  # joins the launch's process group
    torch.manual_seed(demo.seed + rank)  # a different classifier head on each rank, on purpose
    model = models.load_model(demo.model)
    own_init, type_before = flat_params(model), type(model).__name__
    model = accelerator.prepare(model)  # the slide's form
    loader = accelerator.prepare(eval_loader(demo))
    return {
        "rank": rank,
        "distributed_type": str(accelerator.distributed_type),
        "type_before": type_before,
        "type_after": type(model).__name__,
        "device": str(accelerator.device),
        "params_own_init": own_init,
        "params_start": flat_params(model),
        "same_params_all_ranks": same_on_all_ranks(flat_params(model)),
        "rows_read": [list(rows) for rows in loader.batch_sampler],  # this rank's batches, padding included
        **gather_predictions(model, loader, accelerator),
    }


def step_and_eval_worker(rank: int, world_size: int, step: StepDemo, evaluation: EvalDemo) -> dict:
    """``ddp_step_worker`` then ``accelerate_worker`` in the same process (one launch for both)."""
    return {
        "step": ddp_step_worker(rank, world_size, step),
        "eval": accelerate_worker(rank, world_size, evaluation),
    }


def single_process_predictions(demo: EvalDemo) -> dict[str, torch.Tensor]:
    """The reference: one process, rank 0's initial weights, every row once, in order."""
    torch.manual_seed(demo.seed)  # rank 0's seed: prepare (DDP) copies rank 0's weights to every rank
    model = models.load_model(demo.model).eval()
    preds, labels = [], []
    with torch.no_grad():
        for batch in eval_loader(demo):
            preds.append(model(**batch).logits.argmax(dim=-1))
            labels.append(batch["labels"])
    return {"preds": torch.cat(preds), "labels": torch.cat(labels)}


def single_process_step(demo: StepDemo) -> dict:
    """The reference: one process, the whole global batch, the same SGD step (rank 0's initial weights)."""
    torch.manual_seed(demo.seed)  # rank 0's seed: DDP copies rank 0's weights to every rank
    model = disable_dropout(models.load_model(demo.model))
    params_start = flat_params(model)
    tokenized, tokenizer = demo_rows(demo.global_batch, demo.model)
    batch = data.make_collator(tokenizer)([tokenized[i] for i in range(demo.global_batch)])
    loss = model(**batch).loss
    loss.backward()
    grad = flat_grads(model)
    _sgd_step(model, demo.lr)
    return {
        "loss": loss.item(),
        "params_start": params_start,
        "grad": grad,
        "params_after": flat_params(model),
    }


def plot_shards(batches_per_rank: Sequence[Sequence[Sequence[int]]], n: int, ax=None):
    """A ranks x samples grid: which rank reads each sample, and in which of its batches."""
    import matplotlib.pyplot as plt
    import numpy as np

    world_size = len(batches_per_rank)
    grid = np.full((world_size, n), np.nan)
    for rank, batches in enumerate(batches_per_rank):
        for b, rows in enumerate(batches):
            for row in rows:
                grid[rank, row] = b
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 1 + 0.35 * n), 0.6 + 0.55 * world_size))
    # Pastel1 has 9 colours: each batch index 0..8 gets its own
    ax.imshow(grid, aspect="auto", cmap="Pastel1", vmin=0, vmax=8)  # NaN (not read) stays white
    for rank, batches in enumerate(batches_per_rank):
        for b, rows in enumerate(batches):
            for row in rows:
                ax.text(row, rank, str(b), ha="center", va="center", fontsize=9)
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_xticks(range(n))
    ax.set_xlabel("sample index (number = batch on that rank, empty = not read)")
    ax.set_title("Data sharding: who reads which sample")
    return ax


def plot_who_holds_what(stages: dict[str, Sequence[torch.Tensor]], ax=None):
    """A ranks x stages grid: a cell is blue where the rank holds exactly rank 0's tensor, red where not."""
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(stages)
    world_size = len(stages[names[0]])
    same = np.array([[torch.equal(stages[n][r], stages[n][0]) for n in names] for r in range(world_size)])
    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 * len(names) + 1, 0.7 + 0.6 * world_size))
    ax.imshow(np.where(same, 0.0, 1.0), aspect="auto", cmap="coolwarm", vmin=0, vmax=1)
    for r in range(world_size):
        for j in range(len(names)):
            text = "rank 0's" if r == 0 else ("same" if same[r, j] else "different")
            ax.text(j, r, text, ha="center", va="center", fontsize=9)
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_title("Who holds what: blue = bit-for-bit the same as rank 0")
    return ax
