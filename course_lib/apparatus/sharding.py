"""The sharding lesson's demonstrations: the same fine-tune under DDP, ZeRO-1 and FSDP on real ranks.

* ``ddp_model``, ``zero1_optimizer``, ``fsdp_model``, ``build_strategy``: the strategies, as lesson 06b
  shows them line for line. ``ddp`` (``DistributedDataParallel``: everything replicated), ``zero1``
  (``ZeroRedundancyOptimizer``: each rank keeps the AdamW state of its share of the parameters),
  ``fsdp_no_reshard`` and ``fsdp`` (FSDP2's ``fully_shard`` per transformer block and on the model, with
  ``reshard_after_forward=False`` and ``True``: gradients and parameters sharded too).
* ``ShardDemo`` + ``shard_worker``: on every rank of ``course_lib.distributed.launch`` (gloo on CPU),
  the same short AdamW fine-tune from the same start on the same data, once per strategy. DDP's
  ``gradient_as_bucket_view`` is ``ShardDemo.bucket_view``: with True the gradients are views into its
  all-reduce buckets; with DDP's default (False) the buckets are one more full copy of the gradients.
  Per rank: the bytes of parameters, gradients and optimizer state held (local shards), the bytes of
  DDP's buckets that are not the gradients themselves (``bucket copy``), the last step's peak
  (``TensorPeak``), the collectives counted (``instruments.comm``) and the final full parameters.
* ``bytes_rows`` / ``comm_rows`` / ``agreement``: the tables and the check against DDP the lesson prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from course_lib.devices import to_device
from course_lib.distributed import disable_dropout, rank_device, shard_indices
from course_lib.instruments.comm import KINDS, CollectiveLog, counting_collectives
from course_lib.instruments.memory import TensorPeak, _StderrFdCapture, optimizer_state_bytes, tensor_bytes
from course_lib.training.fsdp import transformer_blocks

STRATEGIES = ("ddp", "zero1", "fsdp_no_reshard", "fsdp")
# memory_model's stage of what each holds between steps (FSDP keeps shards at rest either way)
STAGE = {"ddp": "ddp", "zero1": "zero1", "fsdp_no_reshard": "zero3", "fsdp": "zero3"}


@dataclass
class ShardDemo:
    """Each strategy from the same start on the same batches: ``steps`` of ``batch_size`` rows per rank."""

    strategies: tuple[str, ...] = STRATEGIES
    steps: int = 2
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    bucket_view: bool = True  # DDP's gradient_as_bucket_view (False, DDP's default: buckets copy the grads)

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"Unknown strategies {unknown}: use some of {', '.join(STRATEGIES)}.")
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("steps and batch_size must be >= 1 and lr > 0.")


def rank_batches(demo: ShardDemo, world_size: int) -> list[list[dict]]:
    """Each rank's micro-batches (its shard of the embedded training split), built once in the caller.

    Tokenised here rather than in every rank, so the spawned ranks need not import ``datasets``.
    """
    from course_lib import data, models

    tokenizer = models.load_tokenizer()
    collate = data.make_collator(tokenizer)
    rows = demo.steps * demo.batch_size * world_size
    train = data.tokenize_dataset(data.load_mrpc()["train"].select(range(rows)), tokenizer)
    size, out = demo.batch_size, []
    for rank in range(world_size):
        mine = shard_indices(rows, world_size, rank, shuffle=True, seed=demo.seed)
        out.append([collate([train[i] for i in mine[s * size : (s + 1) * size]]) for s in range(demo.steps)])
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return tensor_bytes(_local(t) for t in tensors)  # this rank's shards of FSDP2's DTensors


ADAMW = {"weight_decay": 0.0, "foreach": False}  # one update path for every strategy: parameters compare


def ddp_model(model: torch.nn.Module, bucket_view: bool, buckets: dict) -> DistributedDataParallel:
    """DDP: every rank holds all of the model; backward all-reduces the gradients, bucket by bucket.

    Every bucket the comm hook sees is recorded in ``buckets`` (storage address -> bytes), so that the
    demo can tell whether the buckets are the gradients themselves (``bucket_view``) or one more copy.
    """
    # gradient_as_bucket_view=False (DDP's default): the buckets are one more full copy of the gradients
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)

    def recorded(state, bucket):  # DDP's own all-reduce, called through Python: the demo counts it
        flat = bucket.buffer()  # the bucket's one flat tensor; bucket views share its storage
        buckets[flat.untyped_storage().data_ptr()] = tensor_bytes([flat])
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, recorded)
    return ddp


def zero1_optimizer(ddp: DistributedDataParallel, lr: float) -> ZeroRedundancyOptimizer:
    """ZeRO-1: each rank keeps the AdamW state of its share of the parameters, updates that share
    and broadcasts it to the other ranks (the gradients are still DDP's all-reduced full copies)."""
    return ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, **ADAMW)


def fsdp_model(model: torch.nn.Module, reshard_after_forward: bool) -> torch.nn.Module:
    """FSDP2: parameters, gradients and optimizer state become shards (ZeRO-3 at rest, in place)."""
    for block in transformer_blocks(model):  # one unit per block: one block gathered at a time
        # True: free the gathered block after its forward and gather it again for its backward
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)  # the rest: embeddings, head
    return model


def build_strategy(strategy: str, model: torch.nn.Module, lr: float, bucket_view: bool, buckets: dict):
    """The model and AdamW optimizer of one strategy of ``STRATEGIES``."""
    if strategy == "ddp":
        model = ddp_model(model, bucket_view, buckets)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)
    if strategy == "zero1":  # DDP's all-reduce, then each rank updates its own share
        model = ddp_model(model, bucket_view, buckets)
        return model, zero1_optimizer(model, lr)
    # fsdp_no_reshard keeps each gathered block from its forward to its backward (ZeRO-2's traffic)
    model = fsdp_model(model, reshard_after_forward=strategy == "fsdp")
    return model, torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)  # after sharding: the shards


def _bucket_copy_bytes(buckets: dict, model: torch.nn.Module) -> int:
    """Bytes of DDP's all-reduce buckets whose storage holds none of the gradients (an extra copy)."""
    if not buckets:  # FSDP: no DDP buckets
        return 0
    grad_storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return sum(nbytes for ptr, nbytes in buckets.items() if ptr not in grad_storages)


def _state_holder(optimizer):
    """What ``optimizer_state_bytes`` reads (``.state``), with DTensor states as this rank's shards."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: the rank's local optimizer
    state = {
        p: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in inner.state.items()
    }
    return SimpleNamespace(state=state)


def _full_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one fp32 vector (FSDP2's shards gathered with ``full_tensor``)."""
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten()
            for p in model.parameters()
        ]
    )


def _run(strategy: str, demo: ShardDemo, batches: Sequence[dict], world_size: int) -> dict:
    from course_lib.models import load_model

    torch.manual_seed(demo.seed)  # the classifier head's random init: the same for every strategy
    model = disable_dropout(load_model())  # dropout off: every strategy computes the same function
    buckets: dict[int, int] = {}  # DDP's all-reduce buckets of the step: storage address -> bytes
    model, optimizer = build_strategy(strategy, model, demo.lr, demo.bucket_view, buckets)
    model.train()
    log, grads, bucket_bytes, bucket_copy = CollectiveLog(), 0, 0, 0
    for i, batch in enumerate(batches):
        buckets.clear()  # DDP rebuilds its buckets after the first step: keep this step's only
        peak, log_lines = TensorPeak("cpu"), _StderrFdCapture()
        if i == len(batches) - 1:
            # the profiler's C++ log lines (blocks from before the window freed in it) are filtered out
            log_lines.start()
            peak.start()  # the last step's peak above the weights and state held before it
        with counting_collectives(log):
            loss = model(**batch).loss
            loss.backward()
            # counted before zero_grad(set_to_none=True) frees them: what the rank holds at the step
            grads = _nbytes(p.grad for p in model.parameters() if p.grad is not None)
            bucket_bytes, bucket_copy = sum(buckets.values()), _bucket_copy_bytes(buckets, model)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_peak = peak.stop() * 2**20 if i == len(batches) - 1 else 0.0  # TensorPeak reports MiB
        log_lines.stop()
    state = optimizer_state_bytes(_state_holder(optimizer))
    return {
        "strategy": strategy,
        "params": _nbytes(model.parameters()),
        "grads": grads,
        "buckets": bucket_bytes,
        "bucket_copy": bucket_copy,
        "state": state,
        "step_peak": step_peak,
        "calls": {k: log.calls[k] / len(batches) for k in KINDS},
        "bytes": {k: log.bytes[k] / len(batches) for k in KINDS},
        "ring": log.ring_bytes(world_size) / len(batches),
        "final": _full_params(model),
        "loss": loss.item(),
    }


def shard_worker(rank: int, world_size: int, demo: ShardDemo, batches: Sequence[Sequence[dict]]) -> dict:
    """One rank of the lesson's launch: every strategy of ``demo`` in turn, on ``batches[rank]``."""
    device = rank_device(rank)
    if device.type != "cpu":
        raise RuntimeError("The sharding demo runs on CPU ranks (gloo); on GPUs use accelerate launch.")
    if len(batches) != world_size:
        raise ValueError(
            f"batches has {len(batches)} ranks' shares for {world_size} ranks: use rank_batches."
        )
    batches = [to_device(b, device) for b in batches[rank]]
    runs = [_run(s, demo, batches, world_size) for s in demo.strategies]
    return {"rank": rank, "backend": dist.get_backend(), "runs": runs}


def bytes_rows(results: Sequence[dict]) -> list[dict]:
    """Per strategy and rank: parameter, gradient and optimizer-state bytes held (measured).

    ``bucket copy``: bytes of DDP's all-reduce buckets that are not the gradients themselves (0 when
    the gradients are views into them, ``gradient_as_bucket_view=True``; no buckets under FSDP).
    """
    rows = []
    for res in results:
        for run in res["runs"]:
            total = run["params"] + run["grads"] + run["bucket_copy"] + run["state"]
            rows.append(
                {
                    "strategy": run["strategy"],
                    "rank": res["rank"],
                    "params": run["params"],
                    "grads": run["grads"],
                    "bucket copy": run["bucket_copy"],
                    "optimizer state": run["state"],
                    "total": total,
                }
            )
    return rows


def step_peaks(results: Sequence[dict]) -> dict[str, int]:
    """Per strategy: the largest last-step peak over the ranks (bytes above the weights and state held)."""
    out: dict[str, int] = {}
    for res in results:
        for run in res["runs"]:
            out[run["strategy"]] = max(out.get(run["strategy"], 0), int(run["step_peak"]))
    return out


def comm_rows(results: Sequence[dict]) -> list[dict]:
    """Per strategy (rank 0): collectives per step, their calls and payload bytes, and the ring traffic."""
    rows = []
    for run in results[0]["runs"]:
        row = {"strategy": run["strategy"]}
        for kind in KINDS:
            row[f"{kind} calls"] = int(run["calls"][kind])
            row[f"{kind} bytes"] = int(run["bytes"][kind])
        row["ring bytes/rank"] = int(run["ring"])
        rows.append(row)
    return rows


def agreement(results: Sequence[dict], atol: float = 1e-5) -> dict[str, bool]:
    """Whether each strategy's final parameters equal DDP's (max |difference| <= ``atol``) on every rank."""
    out = {}
    for res in results:
        runs = {run["strategy"]: run["final"] for run in res["runs"]}
        if "ddp" not in runs:
            raise ValueError("agreement needs the 'ddp' strategy as the reference.")
        for name, final in runs.items():
            ok = (final - runs["ddp"]).abs().max().item() <= atol
            out[name] = out.get(name, True) and ok
    return out


def max_difference(results: Sequence[dict]) -> dict[str, float]:
    """Largest |parameter - DDP's parameter| per strategy over all ranks."""
    out: dict[str, float] = {}
    for res in results:
        runs = {run["strategy"]: run["final"] for run in res["runs"]}
        for name, final in runs.items():
            out[name] = max(out.get(name, 0.0), (final - runs["ddp"]).abs().max().item())
    return out
