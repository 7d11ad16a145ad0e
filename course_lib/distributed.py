"""Data-parallel training, one idea at a time: sharding, replication, gradient aggregation, sync.

The building blocks that the training command (``python -m course_lib.cli.train``) and lesson 02 share:

* ``shard_indices``       which sample indices each rank gets (exactly what ``DistributedSampler`` does)
* ``ShardedLoader``       a DataLoader over this rank's shard, its batches on this rank's device
* ``launch``              run a function in N local processes joined by ``torch.distributed``; collect
                          what each rank returns (gloo on CPU, nccl with one GPU per process)
* ``join_elastic_group`` under torchrun: one attempt's keys apart from the last one's (``--max-restarts``)
* ``restore_signal_handlers``  wrap ``accelerate.notebook_launcher`` so the kernel keeps its handlers
* ``average_gradients``   the all-reduce that DistributedDataParallel performs inside ``backward``
* ``flat_params`` / ``flat_grads`` / ``same_on_all_ranks``  compare the replicas
  (lesson 02's demonstrations built on them are in ``course_lib.apparatus.data_parallel``)
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
        per_rank = math.ceil((n - world_size) / world_size)  # DistributedSampler's formula: floor(n / W)
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if shuffle:
        # as DistributedSampler: all ranks draw one permutation
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[:total]
    else:
        while len(order) < total:  # pad by repeating from the start
            order += order[: total - len(order)]
    return order[rank:total:world_size]  # round-robin: rank r takes positions r, r + W, ...


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
            drop_last=drop_last,  # the last, smaller batch of this rank's shard
        )
        self.batch_size, self.drop_last = batch_size, drop_last
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield to_device(batch, self.device)

    def batch_indices(self) -> list[list[int]]:
        """Dataset row indices of each batch this rank reads in the current epoch."""
        rows = list(self.sampler)
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        return [b for b in batches if len(b) == self.batch_size] if self.drop_last else batches


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
        s.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one (another process may take it before use)
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
    process; ``None`` picks) through a file in a temporary folder (a ``FileStore``: no TCP port to
    pick, so nothing else on the machine can take it first), with ``RANK``/``WORLD_SIZE`` set, so an
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
    with tempfile.TemporaryDirectory(prefix="course-launch-") as out_dir:
        torch.multiprocessing.start_processes(
            _run_rank,
            args=(fn, world_size, backend, threads, timeout_s, out_dir, tuple(args)),
            nprocs=world_size,
            start_method=start_method,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def _run_rank(rank, fn, world_size, backend, threads, timeout_s, out_dir, args) -> None:
    """One launched process: join the group (through a file in ``out_dir``), run ``fn``, save its result."""
    torch.set_num_threads(threads)  # N processes x all cores each would oversubscribe the CPU
    # read by an Accelerator() created inside fn, so it joins this group
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before init: each nccl rank owns one GPU
    dist.init_process_group(
        backend,
        init_method=Path(out_dir, "store").as_uri(),  # a FileStore (file:// URL)
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # every rank has saved its result before any rank tears the group down
    finally:
        dist.destroy_process_group()


def join_elastic_group(backend: str, env: dict[str, str] | None = None, timeout_s: float = 1800) -> bool:
    """Under torchrun, form the default process group with this attempt's keys apart from earlier ones'.

    torchrun (torch 2.13) hands its rendezvous store to the workers and keeps it across ``--max-restarts``
    without a per-attempt prefix: a restarted group can read the dead attempt's addresses and stop in
    ``Gloo connectFullMesh failed`` (pytorch/pytorch#135712). The attempt number scopes the keys. Under
    several c10d nodes a node whose worker did not fail restarts without counting: there set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (c10d only; a fresh store per attempt, and this does
    nothing). Static ranks ignore the variable and every node counts alike; a worker cannot tell the two
    apart, so each node's first worker warns until it is set. Returns True when it formed the group."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    nodes, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    told = env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"  # set, and still shared: static ranks
    if nodes > 1 and restarts > 0 and not told and env.get("LOCAL_RANK", "0") == "0":
        warnings.warn(
            f"torchrun: {nodes} nodes with --max-restarts {restarts} share one rendezvous store across "
            "restarts, and under --rdzv-backend c10d each node counts its own attempts: a restarted group "
            "can fail in 'Gloo connectFullMesh failed ... Connection refused' (pytorch/pytorch#135712). Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (docs/distributed.md); with static ranks "
            "(--node-rank) it changes nothing there but silences this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    scoped = dist.PrefixStore(f"course-attempt-{attempt}", store)
    dist.init_process_group(backend, store=scoped, rank=rank, world_size=world, timeout=timeout)
    return True


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
            if handler is not None:  # None: installed outside Python, and signal.signal rejects None
                signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# Replicas, gradients and parameters
# ---------------------------------------------------------------------------------------------


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one fp32 CPU vector, shape (n_params,)."""
    # fp32: bf16 replicas compare too
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
    device = rank_device(dist.get_rank())  # nccl collectives take CUDA tensors only
    mine = tensor.detach().to(device)
    reference = mine.clone()  # broadcast overwrites its argument in place
    dist.broadcast(reference, src=0)
    equal = torch.tensor([int(torch.equal(mine, reference))], device=device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # MIN of 0/1 flags is a logical AND across ranks
    return bool(equal.item())  # note: a CPU-GPU sync point under nccl


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0, in the modules and in a Hugging Face config (a copy built from
    it has none either): the model becomes a deterministic function of its parameters and batch, so
    runs compare exactly. Returns ``model``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("dropout", "attention_dropout", "seq_classif_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return model


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute element-wise difference of two same-shaped tensors (0.0 for empty ones)."""
    if a.shape != b.shape:
        raise ValueError(f"Shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}.")
    if not a.numel():
        return 0.0  # max() of an empty tensor raises
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
