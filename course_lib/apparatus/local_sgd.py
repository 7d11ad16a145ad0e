"""Lesson 05's demonstrations: what each way of keeping data-parallel replicas in step sends, and what it buys.

* counting: ``CommLog`` reads the all-reduce calls, bytes and dtypes one rank hands to the network
  from ``instruments.comm``'s one counter; ``counting_all_reduce`` counts every
  ``torch.distributed.all_reduce`` made inside it (DDP's Python comm hooks, Accelerate's ``LocalSGD``);
  ``counting_hook`` wraps a DDP comm hook so that it counts; ``comm_hook`` picks DDP's hook by name
  (``training.ddp.COMM_HOOKS``, whose "none" the tables call "fp32").
* arithmetic: ``comm_bytes`` (what a strategy should send), ``average_parameters`` (local SGD's
  averaging, for replicas held in one process).
* ``SyncDemo`` + ``sync_worker``: on every rank of ``course_lib.distributed.launch``, each strategy
  (``Variant``) from the same start on the same data: DDP every step, accumulation with ``no_sync``,
  Accelerate's ``LocalSGD``, a compression hook; the bytes per step, the validation loss at sync points,
  and the distance between the replicas before and after each averaging; ``k1_check`` (LocalSGD with
  K=1 against DDP, SGD and AdamW); ``bf16_build_support`` (what DDP's bf16-hook check reads).

It has more than 400 lines because the workers, the records they return and the tables and plots that
read those records belong to one launch of one lesson, and a learner opens them from that lesson.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.devices import to_device
from course_lib.distributed import flat_params, rank_device, same_on_all_ranks, shard_indices
from course_lib.instruments.comm import CollectiveLog, counting_collectives
from course_lib.instruments.memory import MIB
from course_lib.training.ddp import COMM_HOOKS

SYNCS = ("ddp", "accum", "local_sgd")
# The comm hooks are the training loop's (training.ddp.COMM_HOOKS); its "none", DDP's own fp32 all-reduce,
# is labelled "fp32" here and run as the Python hook that does the same, so that it can be counted.
FP32 = "fp32"
HOOKS = tuple(FP32 if name == "none" else name for name in COMM_HOOKS)  # ("fp32", "fp16", "bf16")


# --- Counting what goes to the network -----------------------------------------------------------


@dataclass
class CommLog:
    """All-reduce calls, bytes and dtypes one rank handed to the network (``instruments.comm`` counts)."""

    collectives: CollectiveLog = field(default_factory=CollectiveLog)

    def record(self, tensor: torch.Tensor) -> None:
        """Count one all-reduce of ``tensor`` (its payload: elements x bytes per element)."""
        self.collectives.record("all-reduce", tensor)

    @property
    def calls(self) -> int:
        return self.collectives.calls["all-reduce"]

    @property
    def bytes(self) -> int:
        return self.collectives.bytes["all-reduce"]

    @property
    def dtypes(self) -> set[str]:
        return self.collectives.dtypes["all-reduce"]


@contextmanager
def counting_all_reduce(log: CommLog) -> Iterator[CommLog]:
    """Count into ``log`` every ``torch.distributed.all_reduce`` called inside (innermost counter wins).

    DDP's built-in all-reduce runs in C++ and is not seen; register a Python comm hook
    (``default_hooks.allreduce_hook``, which does the same) to count it.
    """
    with counting_collectives(log.collectives):
        yield log


def counting_hook(hook: Callable) -> Callable:
    """A DDP comm hook that runs ``hook`` and counts what it all-reduces into its state (a ``CommLog``).

    Register it with ``ddp_model.register_comm_hook(log, counting_hook(default_hooks.allreduce_hook))``.
    """

    def counted(log: CommLog, bucket):
        with counting_all_reduce(log):
            return hook(None, bucket)  # None: the default process group

    counted.__name__ = f"counting_{getattr(hook, '__name__', 'hook')}"
    return counted


def comm_hook(name: str) -> Callable:
    """DDP's comm hook for one of ``HOOKS``: ``"fp32"`` (``allreduce_hook``), ``"fp16"``/``"bf16"`` (compress).

    The names are ``training.ddp.COMM_HOOKS``'; its ``"none"`` (DDP's built-in all-reduce, in C++, where
    no counter sees it) is ``"fp32"`` here, run as the Python hook that does the same all-reduce.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name not in HOOKS:
        raise ValueError(f"Unknown hook {name!r}: use one of {', '.join(HOOKS)}.")
    if name == FP32:
        return default_hooks.allreduce_hook
    return getattr(default_hooks, f"{name}_compress_hook")  # fp16_compress_hook, bf16_compress_hook


def comm_bytes(num_params: int, bytes_per_elem: int, steps: int, sync_every: int = 1) -> int:
    """Bytes one rank hands to all-reduce in ``steps`` steps when it syncs all parameters every ``sync_every``."""
    if sync_every < 1 or steps < 0 or num_params < 0 or bytes_per_elem < 1:
        raise ValueError("Need num_params >= 0, bytes_per_elem >= 1, steps >= 0 and sync_every >= 1.")
    return num_params * bytes_per_elem * (steps // sync_every)


@torch.no_grad()
def average_parameters(models: Sequence[torch.nn.Module]) -> None:
    """Set every model's parameters to their mean over ``models`` (local SGD's averaging, in one process)."""
    for params in zip(*(m.parameters() for m in models)):
        mean = torch.stack([p.detach() for p in params]).mean(dim=0)
        for p in params:
            p.copy_(mean)


# --- The two-process demonstration ---------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One way to keep the replicas in step."""

    name: str
    sync: str = (
        "ddp"  # "ddp": all-reduce gradients every step; "accum": no_sync; "local_sgd": average weights
    )
    every: int = 1  # micro-batches per optimizer step ("accum") or local steps per averaging ("local_sgd")
    hook: str = "fp32"  # DDP's wire format for gradients: "fp32", "fp16", "bf16" (a CUDA + NCCL build)

    def __post_init__(self) -> None:
        if self.sync not in SYNCS:
            raise ValueError(f"Unknown sync {self.sync!r}: use one of {', '.join(SYNCS)}.")
        if self.hook not in HOOKS:
            raise ValueError(f"Unknown hook {self.hook!r}: use one of {', '.join(HOOKS)}.")
        if self.every < 1 or (self.sync == "ddp" and self.every != 1):
            raise ValueError(f"{self.name}: every must be >= 1 (and 1 for sync='ddp'), got {self.every}.")


@dataclass
class SyncDemo:
    """Every variant from the same start on the same micro-batches (``steps`` of ``batch_size`` rows per rank)."""

    variants: tuple[Variant, ...] = (
        Variant("DDP"),
        Variant("accumulation k=4", "accum", 4),
        Variant("LocalSGD K=4", "local_sgd", 4),
        Variant("LocalSGD K=16", "local_sgd", 16),
        Variant("DDP + fp16 hook", hook="fp16"),
    )
    steps: int = 32
    batch_size: int = 8
    eval_rows: int = 64  # validation rows, shared out over the ranks
    eval_every: int = 8  # micro-batches between evaluations (only where the replicas are in sync)
    lr: float = 5e-4
    seed: int = 0
    k1_steps: int = 2  # micro-batches of the "LocalSGD K=1 vs DDP" check (0: skip it)
    k1_sgd_lr: float = 0.1  # its plain-SGD learning rate (AdamW uses ``lr``)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.eval_rows < 1 or self.eval_every < 1:
            raise ValueError("steps, batch_size, eval_rows and eval_every must all be >= 1.")
        if not 0 <= self.k1_steps <= self.steps or self.k1_sgd_lr <= 0:
            raise ValueError(f"Need 0 <= k1_steps <= steps ({self.steps}) and k1_sgd_lr > 0.")
        for v in self.variants:
            if self.steps % v.every:
                raise ValueError(f"{v.name}: steps={self.steps} is not a multiple of every={v.every}.")


def _batches(demo: SyncDemo, rank: int, world_size: int, device) -> tuple[list[dict], dict]:
    """This rank's training micro-batches and its share of the validation rows."""
    from course_lib import data, models

    tokenizer = models.load_tokenizer()
    collate = data.make_collator(tokenizer)
    rows = demo.steps * demo.batch_size * world_size
    train = data.tokenize_dataset(data.load_mrpc()["train"].select(range(rows)), tokenizer)
    # one permutation, disjoint shards
    mine = shard_indices(rows, world_size, rank, shuffle=True, seed=demo.seed)
    size = demo.batch_size
    batches = [
        to_device(collate([train[i] for i in mine[s * size : (s + 1) * size]]), device)
        for s in range(demo.steps)
    ]
    val = data.tokenize_dataset(data.load_mrpc()["validation"].select(range(demo.eval_rows)), tokenizer)
    # round-robin: each validation row on exactly one rank
    eval_batch = to_device(collate([val[i] for i in range(rank, demo.eval_rows, world_size)]), device)
    return batches, eval_batch


@torch.no_grad()
def _val_loss(model: torch.nn.Module, batch: dict) -> float:
    """Mean validation loss over all ranks' rows (gathered with all_gather: not counted as training traffic)."""
    model.eval()
    n = batch["labels"].numel()
    # sum and count: ranks with unequal shares still average right
    mine = torch.tensor(
        [model(**batch).loss.item() * n, n], dtype=torch.float64, device=batch["labels"].device
    )
    model.train()
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # the list form, which instruments.comm does not count
    total = torch.stack(gathered).sum(dim=0)
    return (total[0] / total[1]).item()


def replica_drift(model: torch.nn.Module, anchor: torch.Tensor) -> dict[str, float]:
    """How far the replicas are apart, and how their moves since ``anchor`` (the last average) compare.

    ``distance``: largest L2 distance between rank 0's flattened parameters and another rank's (0: in
    sync); ``moved``: rank 0's L2 distance from ``anchor``; ``cosine``: between rank 0's and rank 1's
    moves since ``anchor`` (1: the same direction, 0: unrelated; 0 when nothing moved).
    """
    device = rank_device(dist.get_rank())
    mine, anchor = flat_params(model).to(device), anchor.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # the list form, which instruments.comm does not count
    moves = [g - anchor for g in gathered]
    # moves[-1]: rank 1 of the lesson's two
    cosine = torch.nn.functional.cosine_similarity(moves[0], moves[-1], dim=0).item()
    return {
        "distance": max((g - gathered[0]).norm().item() for g in gathered),
        "moved": moves[0].norm().item(),
        "cosine": cosine,
    }


def bf16_build_support() -> dict:
    """The facts DDP's check for ``bf16_compress_hook`` reads, and its verdict (``accepts``).

    The same test as ``DistributedDataParallel._check_comm_hook`` (torch 2.13): a CUDA or ROCm build
    with NCCL 2.10+, or XPU with XCCL. The process group's backend is not part of it.
    """
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else None
    xccl = dist.is_available() and dist.is_xccl_available() and torch.xpu.is_available()
    cuda_and_nccl = (cuda is not None or hip is not None) and nccl and torch.cuda.nccl.version() >= (2, 10)
    return {
        "torch.version.cuda": cuda,
        "torch.version.hip": hip,
        "NCCL": nccl_version or "not built in",
        "XPU + XCCL": xccl,
        "accepts": bool(cuda_and_nccl or xccl),
    }


def bf16_all_reduce_check() -> bool:
    """All-reduce a bfloat16 tensor over this group: True when every rank gets the right sum."""
    world_size = dist.get_world_size()
    mine = torch.full(
        (8,), float(dist.get_rank() + 1), dtype=torch.bfloat16, device=rank_device(dist.get_rank())
    )
    dist.all_reduce(mine)  # not training traffic: called outside every counting block
    expected = world_size * (world_size + 1) / 2
    return mine.dtype == torch.bfloat16 and bool((mine.float() == expected).all())


def bf16_hook_check() -> str:
    """Try to register ``bf16_compress_hook`` in this group: ``"ok"`` or the error DDP raises.

    DDP refuses it in a PyTorch build without CUDA + NCCL 2.10+ (or XPU + XCCL), whatever the backend
    (``bf16_build_support``).
    """
    from torch.nn.parallel import DistributedDataParallel

    probe = torch.nn.Linear(2, 2).to(rank_device(dist.get_rank()))
    try:
        DistributedDataParallel(probe).register_comm_hook(None, comm_hook("bf16"))
    except (TypeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def _run_variant(variant: Variant, demo: SyncDemo, accelerator, batches, eval_batch, rank: int) -> dict:
    """Train one variant from the shared start; return its counts, loss curve and replica distances."""
    from accelerate.local_sgd import LocalSGD

    from course_lib import models

    torch.manual_seed(demo.seed)  # the same start on every rank (DDP also broadcasts rank 0's)
    model = accelerator.prepare(models.load_model())  # DistributedDataParallel across the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo.lr)
    log, exit_log, grad_log = CommLog(), CommLog(), CommLog()
    local = variant.sync == "local_sgd"
    # Every gradient bucket DDP all-reduces goes through this hook; under LocalSGD it counts into
    # grad_log (averaging goes to log), so a gradient all-reduce inside no_sync would show there.
    model.register_comm_hook(grad_log if local else log, counting_hook(comm_hook(variant.hook)))
    torch.manual_seed(demo.seed + 1 + rank)  # dropout draws differ per rank, as in any data-parallel run
    anchor = flat_params(model)  # the parameters at the last average (local SGD)
    curve = [{"step": 0, "bytes": 0, "val_loss": _val_loss(model, eval_batch)}]
    drift, step_calls, optimizer_steps = [], [], 0
    with ExitStack() as stack:
        if local:
            stack.enter_context(counting_all_reduce(exit_log))  # counts the average LocalSGD makes on exit
            local_sgd = stack.enter_context(
                LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=variant.every, enabled=True)
            )
        for step, batch in enumerate(batches, start=1):
            update = variant.sync != "accum" or step % variant.every == 0
            no_sync = model.no_sync() if variant.sync == "accum" and not update else nullcontext()
            with no_sync:
                # accum: the mean over the window
                loss = model(**batch).loss / (variant.every if variant.sync == "accum" else 1)
                loss.backward()  # DDP all-reduces the gradients here (unless no_sync)
            if update:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                optimizer_steps += 1
            if local:
                apart = replica_drift(model, anchor)
                with counting_all_reduce(log):
                    local_sgd.step()  # averages the parameters every local_sgd_steps calls
                after = replica_drift(model, anchor)["distance"]
                drift.append(
                    {"step": step, "before": apart["distance"], "after": after}
                    | {"moved": apart["moved"], "cosine": apart["cosine"]}
                )
                if step % variant.every == 0:
                    anchor = flat_params(model)
            step_calls.append(log.calls - sum(step_calls))  # this micro-step's calls
            if step % demo.eval_every == 0 and step % variant.every == 0:  # only where the replicas agree
                curve.append({"step": step, "bytes": log.bytes, "val_loss": _val_loss(model, eval_batch)})
    params = list(model.parameters())
    return {
        "rank": rank,
        "name": variant.name,
        "sync": variant.sync,
        "every": variant.every,
        "hook": "-" if local else variant.hook,
        "micro_steps": len(batches),
        "optimizer_steps": optimizer_steps,
        "calls": log.calls,
        "step_calls": step_calls,  # all-reduce calls in each micro-step
        "bytes": log.bytes,
        "dtypes": sorted(log.dtypes),
        "exit_calls": exit_log.calls,
        "exit_bytes": exit_log.bytes,
        "grad_calls": grad_log.calls if local else log.calls,  # gradient all-reduces inside DDP
        "total_calls": log.calls + exit_log.calls,
        "total_bytes": log.bytes + exit_log.bytes,  # everything this rank sent, the average on exit too
        "parameters": sum(p.numel() for p in params),
        "parameter_tensors": len(params),
        "curve": curve,
        "drift": drift,
        "same_at_end": same_on_all_ranks(flat_params(model)),
    }


def _k1_run(sync: str, optimizer: str, demo: SyncDemo, accelerator, batches) -> torch.Tensor:
    """Parameters after ``demo.k1_steps`` micro-batches of DDP or LocalSGD K=1, dropout off."""
    from accelerate.local_sgd import LocalSGD

    from course_lib import models
    from course_lib.distributed import disable_dropout

    torch.manual_seed(demo.seed)  # the same start for all four runs
    model = accelerator.prepare(disable_dropout(models.load_model()))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=demo.k1_sgd_lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=demo.lr)
    local = (
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1, enabled=True)
        if sync == "local_sgd"
        else nullcontext()
    )
    with local:
        for batch in batches[: demo.k1_steps]:
            model(**batch).loss.backward()  # DDP averages the gradients here (not under LocalSGD)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sync == "local_sgd":
                local.step()  # K=1: averages the parameters after every step
    return flat_params(model)


def k1_check(demo: SyncDemo, accelerator, batches) -> dict:
    """LocalSGD with K=1 against DDP, with plain SGD and with AdamW: rank 0's parameters after each.

    With SGD, averaging the parameters after each local step is averaging the gradients (the update is
    linear in the gradient); AdamW divides each rank's gradient by its own running scale first.
    """
    return {
        (sync, opt): _k1_run(sync, opt, demo, accelerator, batches)
        for opt in ("sgd", "adamw")
        for sync in ("ddp", "local_sgd")
    }


def sync_worker(rank: int, world_size: int, demo: SyncDemo) -> dict:
    """One rank of the lesson's launch: every variant of ``demo`` in turn, plus the bf16-hook check."""
    from accelerate import Accelerator

    device = rank_device(rank)
    # Accelerate resets the thread count of CPU processes unless OMP_NUM_THREADS says it: keep the launch's.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    accelerator = Accelerator(cpu=device.type == "cpu")  # joins the launch's process group
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"The Accelerator sees {accelerator.num_processes} processes, not {world_size}.")
    batches, eval_batch = _batches(demo, rank, world_size, device)
    runs = [_run_variant(v, demo, accelerator, batches, eval_batch, rank) for v in demo.variants]
    k1 = k1_check(demo, accelerator, batches) if demo.k1_steps else {}
    return {
        "rank": rank,
        "distributed_type": str(accelerator.distributed_type),
        "backend": dist.get_backend(),
        "bf16_hook": bf16_hook_check(),
        "bf16_build": bf16_build_support(),
        "bf16_all_reduce": bf16_all_reduce_check(),
        "k1": {f"{sync} {opt}": params for (sync, opt), params in k1.items()},
        "runs": runs,
    }


# --- Tables and plots ----------------------------------------------------------------------------


def count_rows(runs: Sequence[dict]) -> list[dict]:
    """The deterministic part of each run: steps, all-reduce calls and bytes (in the loop, on leaving
    LocalSGD's block, in total), per micro-batch, and how many times less than ``runs[0]`` in total."""
    reference = runs[0]["total_bytes"]
    return [
        {
            "variant": r["name"],
            "micro-batches": r["micro_steps"],
            "optimizer steps": r["optimizer_steps"],
            "all-reduce calls": r["total_calls"],
            "dtype": ",".join(r["dtypes"]) or "-",
            "MiB in loop": round(r["bytes"] / MIB, 2),
            "MiB on exit": round(r["exit_bytes"] / MIB, 2),
            "MiB total": round(r["total_bytes"] / MIB, 2),
            "bytes/param/micro-batch": round(r["total_bytes"] / r["parameters"] / r["micro_steps"], 3),
            f"x less than {runs[0]['name']}": round(reference / r["total_bytes"], 1)
            if r["total_bytes"]
            else "-",
        }
        for r in runs
    ]


def plot_loss_vs_bytes(runs: Sequence[dict], axes=None):
    """Validation loss against MiB sent (log scale) and against micro-batches seen, one line per variant."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    start = runs[0]["curve"][0]["val_loss"]
    for r in runs:
        points = r["curve"][1:]  # the start (0 bytes) cannot sit on a log axis
        axes[0].plot(
            [p["bytes"] / MIB for p in points], [p["val_loss"] for p in points], "o-", label=r["name"]
        )
        axes[1].plot(
            [p["step"] for p in r["curve"]], [p["val_loss"] for p in r["curve"]], "o-", label=r["name"]
        )
    for ax in axes:
        ax.axhline(start, color="gray", linestyle=":", linewidth=1, label="start")
        ax.set_ylabel("validation loss")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("MiB handed to all-reduce per rank (log scale)")
    axes[1].set_xlabel("micro-batches per rank (examples seen / batch size)")
    axes[0].set_title("Loss against communication"), axes[1].set_title("Loss against data seen")
    axes[1].legend(fontsize=8)
    plt.tight_layout()
    return axes


def drift_series(drift: Sequence[dict]) -> tuple[list[float], list[float]]:
    """A saw-tooth for plotting: x and y of the distance after each step, dropping at each averaging."""
    xs, ys = [0.0], [0.0]
    for d in drift:
        xs.append(d["step"])
        ys.append(d["before"])
        if not math.isclose(d["before"], d["after"]):
            xs.append(d["step"])
            ys.append(d["after"])
    return xs, ys


def plot_drift(runs: Sequence[dict], ax=None):
    """Distance between the two replicas' parameters over the local steps of each LocalSGD run."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    for r in runs:
        if r["drift"]:
            ax.plot(*drift_series(r["drift"]), label=r["name"])
    ax.set_xlabel("local step")
    ax.set_ylabel("L2 distance rank 0 - rank 1")
    ax.set_title("Replicas drift apart between averagings")
    ax.legend(fontsize=8)
    return ax
