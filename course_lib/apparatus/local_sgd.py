"""Lesson 05's launch: each way of keeping data-parallel replicas in step, trained from the same start on
the same data on every rank of ``course_lib.distributed.launch``.

The technique is in the functions the lesson shows line for line (its cells define them with the same
text; the spawned processes run these copies): ``ddp_loop`` (DDP, accumulation with ``no_sync``),
``local_sgd_loop`` (Accelerate's ``LocalSGD`` block with ``local_sgd.step()``), ``run_variant`` (the
counting comm hook registered on the prepared model), ``bf16_hook_check`` and ``bf16_all_reduce_check``.
The rest is the shell: ``Variant`` and ``SyncDemo`` (what to run), ``k1_check`` (LocalSGD with K=1
against DDP, SGD and AdamW, through the same loops), ``sync_worker`` (one rank: every variant in turn).
Counting lives in ``local_sgd_counting``, recording and the tables in ``local_sgd_record``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate.local_sgd import LocalSGD

from course_lib.apparatus.local_sgd_counting import HOOKS, comm_hook, counting_all_reduce, counting_hook
from course_lib.apparatus.local_sgd_record import Recorder
from course_lib.devices import to_device
from course_lib.distributed import disable_dropout, flat_params, rank_device, shard_indices
from course_lib.models import load_model

SYNCS = ("ddp", "accum", "local_sgd")


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


# --- The technique: the lesson shows these functions line for line -----------------------------------


def ddp_loop(model, optimizer, batches: list[dict], accumulate: int, rec: Recorder) -> None:
    """DDP: every backward all-reduces the gradients; with ``accumulate`` > 1 only every accumulate-th."""
    for step, batch in enumerate(batches, start=1):
        sync = step % accumulate == 0  # the window's last micro-batch: all-reduce, then step
        with nullcontext() if sync else model.no_sync():  # no_sync: the gradients stay local and add up
            loss = model(**batch).loss / accumulate  # the mean over the window
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket (not under no_sync)
        if sync:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        rec.step(model, step, updated=sync, in_sync=sync)


def local_sgd_loop(accelerator, model, optimizer, batches: list[dict], k: int, rec: Recorder) -> None:
    """Local SGD: each rank steps on its own batches, and every ``k`` steps the parameters are averaged."""
    with (
        counting_all_reduce(rec.on_exit),  # counts the average LocalSGD makes when the block ends
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=k, enabled=True) as local_sgd,
    ):
        for step, batch in enumerate(batches, start=1):
            loss = model(**batch).loss
            loss.backward()  # inside LocalSGD's no_sync: DDP all-reduces no gradient
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            before = rec.replicas(model)  # how far apart the replicas are before averaging
            with counting_all_reduce(rec.averages):
                local_sgd.step()  # every k-th call: average the parameters (one all-reduce per tensor)
            rec.step(model, step, updated=True, in_sync=step % k == 0, before=before)


def run_variant(variant: Variant, demo: SyncDemo, accelerator, batches: list[dict], eval_batch: dict) -> dict:
    """Train one variant from the shared start; return what this rank sent and saw (``Recorder.result``)."""
    torch.manual_seed(demo.seed)  # the same start on every rank (DDP also broadcasts rank 0's)
    model = accelerator.prepare(load_model())  # DistributedDataParallel across the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo.lr)
    rec = Recorder(eval_batch, demo.eval_every)
    # Every gradient bucket DDP all-reduces goes through the hook, which counts it into rec.grads
    # (under LocalSGD too: a gradient all-reduce inside its no_sync would show there).
    model.register_comm_hook(rec.grads, counting_hook(comm_hook(variant.hook)))
    torch.manual_seed(demo.seed + 1 + dist.get_rank())  # dropout draws differ per rank, as in any DDP run
    rec.start(model)
    if variant.sync == "local_sgd":
        local_sgd_loop(accelerator, model, optimizer, batches, variant.every, rec)
    else:  # "ddp" (every=1) or "accum"
        ddp_loop(model, optimizer, batches, variant.every, rec)
    return rec.result(variant, model)


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


def bf16_all_reduce_check() -> bool:
    """All-reduce a bfloat16 tensor over this group: True when every rank gets the right sum."""
    world_size = dist.get_world_size()
    mine = torch.full(
        (8,), float(dist.get_rank() + 1), dtype=torch.bfloat16, device=rank_device(dist.get_rank())
    )
    dist.all_reduce(mine)  # not training traffic: called outside every counting block
    expected = world_size * (world_size + 1) / 2
    return mine.dtype == torch.bfloat16 and bool((mine.float() == expected).all())


# --- The shell ------------------------------------------------------------------------------------


def k1_check(demo: SyncDemo, accelerator, batches: list[dict]) -> dict[str, torch.Tensor]:
    """LocalSGD with K=1 against DDP, with plain SGD and with AdamW: this rank's parameters after
    ``demo.k1_steps`` micro-batches of each (dropout off), through the lesson's ``ddp_loop`` and
    ``local_sgd_loop``, keyed ``"<sync> <optimizer>"``.

    With SGD, averaging the parameters after each local step is averaging the gradients (the update is
    linear in the gradient); AdamW divides each rank's gradient by its own running scale first.
    """
    params = {}
    for opt in ("sgd", "adamw"):
        for sync in ("ddp", "local_sgd"):
            torch.manual_seed(demo.seed)  # the same start for all four runs
            model = accelerator.prepare(disable_dropout(load_model()))
            if opt == "sgd":
                optimizer = torch.optim.SGD(model.parameters(), lr=demo.k1_sgd_lr)
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=demo.lr)
            rec = Recorder()  # no validation loss
            rec.start(model)
            if sync == "ddp":  # DDP's own C++ all-reduce: no comm hook registered
                ddp_loop(model, optimizer, batches[: demo.k1_steps], 1, rec)
            else:
                local_sgd_loop(accelerator, model, optimizer, batches[: demo.k1_steps], 1, rec)
            params[f"{sync} {opt}"] = flat_params(model)
    return params


def sync_worker(rank: int, world_size: int, demo: SyncDemo) -> dict:
    """One rank of the lesson's launch: every variant of ``demo`` in turn, the K=1 check, the bf16 checks."""
    from accelerate import Accelerator

    from course_lib.apparatus.local_sgd_counting import bf16_build_support

    device = rank_device(rank)
    # Accelerate resets the thread count of CPU processes unless OMP_NUM_THREADS says it: keep the launch's.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    accelerator = Accelerator(cpu=device.type == "cpu")  # joins the launch's process group
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"The Accelerator sees {accelerator.num_processes} processes, not {world_size}.")
    batches, eval_batch = _batches(demo, rank, world_size, device)
    runs = [run_variant(v, demo, accelerator, batches, eval_batch) for v in demo.variants]
    k1 = k1_check(demo, accelerator, batches) if demo.k1_steps else {}
    return {
        "rank": rank,
        "distributed_type": str(accelerator.distributed_type),
        "backend": dist.get_backend(),
        "bf16_hook": bf16_hook_check(),
        "bf16_build": bf16_build_support(),
        "bf16_all_reduce": bf16_all_reduce_check(),
        "k1": k1,
        "runs": runs,
    }
