"""Data-parallel training, one idea at a time: sharding, replication, gradient aggregation, sync.

The building blocks that the training command (``python -m course_lib.train``) and lesson 02 share:

* ``shard_indices``       which sample indices each rank gets (exactly what ``DistributedSampler`` does)
* ``ShardedLoader``       a DataLoader over this rank's shard, its batches on this rank's device
* ``launch``              run a function in N local processes joined by ``torch.distributed``; collect
                          what each rank returns (gloo on CPU, nccl with one GPU per process)
* ``restore_signal_handlers``  wrap ``accelerate.notebook_launcher`` so the kernel keeps its handlers
* ``average_gradients``   the all-reduce that DistributedDataParallel performs inside ``backward``
* ``flat_params`` / ``flat_grads`` / ``same_on_all_ranks``  compare the replicas
* ``sharding_worker`` / ``ddp_step_worker`` / ``single_process_step``  lesson 02's demonstrations;
  they live here (not in the notebook) because spawned processes can only run importable functions
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from course_lib.devices import to_device

BACKENDS = ("gloo", "nccl")
START_METHODS = ("spawn", "fork", "forkserver")


# ---------------------------------------------------------------------------------------------
# Data sharding
# ---------------------------------------------------------------------------------------------


def check_world(world_size: int, rank: int | None = None) -> None:
    """Raise a clear error unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of processes), got {world_size!r}.")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(
            f"rank must be an integer in 0..{world_size - 1} for world_size={world_size}, got {rank!r}."
        )


def shard_indices(
    n: int,
    world_size: int,
    rank: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[int]:
    """The sample indices ``rank`` reads in one epoch: the same list as ``DistributedSampler``.

    Every rank gets ``ceil(n / world_size)`` indices, taken round-robin (rank r: positions r, r + W, ...)
    from ``range(n)`` or, with ``shuffle``, from a permutation seeded by ``seed + epoch`` that all ranks
    share. When ``n`` is not a multiple of ``world_size`` the list is padded with indices from its
    start (a few samples are seen twice), or with ``drop_last`` the tail is dropped instead.
    """
    check_world(world_size, rank)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative number of samples, got {n!r}.")
    if n == 0:
        return []
    if drop_last and n % world_size:
        per_rank = math.ceil((n - world_size) / world_size)
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[:total]
    else:
        while len(order) < total:  # pad by repeating from the start
            order += order[: total - len(order)]
    return order[rank:total:world_size]


class ShardedLoader:
    """Batches of this rank's shard of ``dataset`` (a ``DistributedSampler``), moved to ``device``.

    Deliberately not a ``DataLoader`` subclass: ``accelerator.prepare`` passes it through unchanged
    instead of sharding it a second time. ``sampler.set_epoch(e)`` reshuffles (the training loop
    calls it); the order depends only on ``seed`` and the epoch, so a resumed run sees the same data.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate_fn: Callable | None = None,
        world_size: int = 1,
        rank: int = 0,
        device: torch.device | str = "cpu",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        check_world(world_size, rank)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if len(dataset) == 0:
            raise ValueError("Cannot shard an empty dataset: select at least one row.")
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        # Its own generator: creating the iterator then draws no number from the global RNG.
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            generator=torch.Generator().manual_seed(seed),
        )
        self.batch_size = batch_size
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield to_device(batch, self.device)

    def batch_indices(self) -> list[list[int]]:
        """Dataset row indices of each batch this rank reads in the current epoch."""
        rows = list(self.sampler)
        return [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]


# ---------------------------------------------------------------------------------------------
# Launching N processes
# ---------------------------------------------------------------------------------------------


def default_backend(world_size: int = 1) -> str:
    """``"nccl"`` when there is one CUDA GPU per process, else ``"gloo"`` (CPU)."""
    enough_gpus = torch.cuda.device_count() >= world_size  # counts without initialising CUDA
    return "nccl" if enough_gpus and dist.is_nccl_available() else "gloo"


def check_backend(backend: str | None, world_size: int = 1) -> str:
    """Normalise ``backend`` (``None``: ``default_backend``) and check that it can run here."""
    check_world(world_size)
    if backend is None:
        return default_backend(world_size)
    name = str(backend).strip().lower()
    if name not in BACKENDS:
        raise ValueError(
            f"Unsupported backend {backend!r}: use 'gloo' (CPU, any machine) or 'nccl' (one CUDA GPU per "
            "process), or None to choose automatically."
        )
    if name == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"backend='nccl' needs one CUDA GPU per process: {world_size} processes, "
            f"{torch.cuda.device_count()} GPU(s) here. Use backend='gloo' (CPU) or fewer processes."
        )
    return name


def rank_device(rank: int, backend: str | None = None) -> torch.device:
    """The device a rank computes on: ``cuda:<rank>`` under nccl, else the CPU."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def free_port() -> int:
    """A TCP port on localhost that is free right now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    backend: str | None = None,
    threads: int = 1,
    start_method: str = "spawn",
    timeout_s: float = 300,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes; return their results.

    Each process joins one ``torch.distributed`` group (``backend``: gloo on CPU, nccl with one GPU per
    process; ``None`` picks) with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, so an
    ``Accelerator()`` created inside ``fn`` joins it too. ``threads`` torch threads per process keep two
    processes from fighting over two cores. What ``fn`` returns (tensors, numbers, strings, lists and
    dicts of them) comes back as a list in rank order. An exception in any rank is re-raised here.

    With ``start_method="spawn"`` (the default, safe everywhere) ``fn`` must be importable from a
    module: a function defined in a notebook cannot be sent to a spawned process. ``"fork"`` accepts
    any function, but only before this process has run multi-threaded torch work (the children hang
    in OpenMP otherwise) or touched CUDA.
    """
    check_world(world_size)
    backend = check_backend(backend, world_size)
    if start_method not in START_METHODS:
        raise ValueError(f"Unknown start_method {start_method!r}: use one of {', '.join(START_METHODS)}.")
    if start_method != "fork" and getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} is defined in the notebook or script itself; spawned "
            "processes cannot import it. Put it in a module (see course_lib.distributed's workers)."
        )
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}.")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="course-launch-") as out_dir:
        torch.multiprocessing.start_processes(
            _run_rank,
            args=(fn, world_size, backend, port, threads, timeout_s, out_dir, tuple(args)),
            nprocs=world_size,
            start_method=start_method,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def _run_rank(rank, fn, world_size, backend, port, threads, timeout_s, out_dir, args) -> None:
    """One launched process: join the group, run ``fn``, save its result for the parent."""
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextmanager
def restore_signal_handlers(
    names: Sequence[str] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"),
) -> Iterator[None]:
    """Put this process's signal handlers back afterwards.

    ``accelerate.notebook_launcher`` runs torch's elastic launcher inside the kernel, which installs
    its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers and leaves them there: interrupting or shutting
    down the kernel later raises ``SignalException``. Wrap the launcher call in this.
    """
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# Replicas, gradients and parameters
# ---------------------------------------------------------------------------------------------


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one fp32 CPU vector, shape (n_params,)."""
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """All gradients as one fp32 CPU vector, shape (n_params,) (zeros where a gradient is None)."""
    return torch.cat(
        [
            (p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
            .flatten()
            .cpu()
            for p in model.parameters()
        ]
    )


def param_slices(model: torch.nn.Module) -> dict[str, slice]:
    """Where each named parameter lives in ``flat_params(model)``."""
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = slice(start, start + p.numel())
        start += p.numel()
    return out


def _require_group() -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            "No torch.distributed process group: call this inside a launched process "
            "(course_lib.distributed.launch, torchrun, accelerate launch)."
        )


def average_gradients(model: torch.nn.Module) -> None:
    """All-reduce every gradient and divide by the world size (in place): what DDP does in backward."""
    _require_group()
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # every rank receives the sum
            p.grad /= world_size


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    """True on every rank when ``tensor`` is bit-for-bit the same on all ranks."""
    _require_group()
    device = rank_device(dist.get_rank())
    mine = tensor.detach().to(device)
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    equal = torch.tensor([int(torch.equal(mine, reference))], device=device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal.item())


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (exact comparisons between runs); returns ``model``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


# ---------------------------------------------------------------------------------------------
# Lesson 02: the four ideas, each recorded on every rank
# ---------------------------------------------------------------------------------------------


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
    from course_lib import data, models

    tokenizer = models.load_tokenizer(model)
    split = data.load_mrpc()["train"].select(range(rows))
    return data.tokenize_dataset(split, tokenizer), tokenizer


def sharding_worker(rank: int, world_size: int, rows: int, batch_size: int, seed: int = 0) -> dict:
    """Which dataset rows this rank's ``ShardedLoader`` reads in epoch 0 (row indices per batch)."""
    from course_lib import data

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


def ddp_step_worker(rank: int, world_size: int, demo: StepDemo) -> dict:
    """One data-parallel step on this rank, recording what the rank holds at each stage."""
    from torch.nn.parallel import DistributedDataParallel

    from course_lib import data, models

    device = rank_device(rank)
    # A different seed on each rank on purpose: without a broadcast the replicas would differ.
    torch.manual_seed(demo.seed + rank)
    model = disable_dropout(models.load_model(demo.model)).to(device)
    params_own_init = flat_params(model)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers to every rank
    params_start = flat_params(model)

    # Data sharding: this rank's rows of the global batch.
    tokenized, tokenizer = demo_rows(demo.global_batch, demo.model)
    rows = shard_indices(demo.global_batch, world_size, rank)
    batch = to_device(data.make_collator(tokenizer)([tokenized[i] for i in rows]), device)

    # Model replication: forward and backward on the local shard, no communication (no_sync).
    with ddp.no_sync():
        loss = ddp(**batch).loss
        loss.backward()
    grad_local = flat_grads(model)

    # Gradient aggregation, by hand: all-reduce (sum) and divide by the number of ranks.
    average_gradients(model)
    grad_averaged = flat_grads(model)

    # The same, done by DDP itself: a normal backward all-reduces the gradients in buckets.
    model.zero_grad(set_to_none=True)
    ddp(**batch).loss.backward()
    grad_ddp = flat_grads(model)

    # Parameter sync, DDP style: every rank applies the same averaged gradient.
    _sgd_step(model, demo.lr)
    params_after = flat_params(model)

    # Parameter sync, as on the slide: rank 0 aggregates, updates and shares the parameters.
    grad_sum = grad_local.clone().to(device)
    dist.reduce(grad_sum, dst=0, op=dist.ReduceOp.SUM)
    shared = params_start.clone().to(device)
    if rank == 0:
        shared -= demo.lr * grad_sum / world_size
    dist.broadcast(shared, src=0)

    return {
        "rank": rank,
        "rows": rows,
        "loss": loss.item(),
        "params_own_init": params_own_init,
        "params_start": params_start,
        "grad_local": grad_local,
        "grad_averaged": grad_averaged,
        "grad_ddp": grad_ddp,
        "params_after": params_after,
        "params_after_rank0_update": shared.cpu(),
        "same_params_all_ranks": same_on_all_ranks(params_after),
        "slices": {k: (s.start, s.stop) for k, s in param_slices(model).items()},
    }


def single_process_step(demo: StepDemo) -> dict:
    """The reference: one process, the whole global batch, the same SGD step (rank 0's initial weights)."""
    from course_lib import data, models

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


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute element-wise difference of two same-shaped tensors."""
    if a.shape != b.shape:
        raise ValueError(f"Shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}.")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


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
