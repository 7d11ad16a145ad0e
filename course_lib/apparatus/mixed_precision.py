"""Lesson 03's demonstrations: the three efficiencies of mixed precision, each measured, not derived.

* memory: the bytes autograd saves for backward (``instruments.memory.SavedTensors``), by dtype, in
  fp32 and under autocast, the new tensors apart from the parameters saved as-is; what stays 32-bit (weights, gradients, AdamW state) read from the tensors;
  what casting the whole model does to weight memory, and what it costs (small updates lost); the
  16-bit weight copies autocast caches for the length of an ``autocast`` block.
* communication: the bytes DDP's all-reduce really sends per step, counted in two real processes,
  with the default hook (fp32) and with a compression hook (``fp16_compress_hook``; DDP accepts
  ``bf16_compress_hook`` only in a CUDA/ROCm build with NCCL >= 2.10 or an XPU build with XCCL, whatever the
  process group's backend: a ``+cpu`` build refuses it, see lesson 05), by ``instruments.comm``'s counter;
  the parameters after the same steps. ``comm_worker`` is shown line for line by the lesson;
  ``comm_row`` records what it counted.
* compute: the per-round speed-ups of interleaved training steps and the lesson's verdict sentences.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from course_lib import models
from course_lib.apparatus.data_parallel import local_batch
from course_lib.apparatus.local_sgd import HOOKS, comm_hook
from course_lib.devices import to_device
from course_lib.distributed import disable_dropout, flat_params, rank_device
from course_lib.instruments.comm import CollectiveLog, counting_collectives
from course_lib.instruments.memory import MIB, SavedTensors, tensor_bytes
from course_lib.mixed_precision import FASTER, PrecisionAdvice, autocast_dtype


def saved_activation_bytes(
    model: torch.nn.Module, batch: dict, precision: str = "no"
) -> dict[str, dict[str, int]]:
    """Bytes of the tensors autograd saves for backward in one forward pass, per dtype, in two parts.

    ``"new"``: tensors the forward pass created to keep (activations, autocast's 16-bit weight copies);
    ``"parameters"``: the model's own parameters saved as-is (an fp32 weight that ``linear`` or
    ``layer_norm`` keeps), which cost no memory beyond the weights themselves. Seen through
    ``instruments.memory.SavedTensors``; a storage saved several times counts once.
    """
    device = next(model.parameters()).device
    batch = to_device(batch, device)
    ctx = (
        nullcontext()
        if precision == "no"
        else torch.autocast(device_type=device.type, dtype=autocast_dtype(precision))
    )
    with SavedTensors(keep=True) as saved, ctx:
        loss = model(**batch).loss
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parts: dict[str, dict[str, int]] = {"new": {}, "parameters": {}}
    seen: set[int] = set()
    for t in saved.tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:  # the graph holds every saved tensor until backward: no address is reused
            seen.add(key)
            part = parts["parameters" if key in own else "new"]
            dtype = str(t.dtype).removeprefix("torch.")
            part[dtype] = part.get(dtype, 0) + tensor_bytes([t])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return parts


def autocast_weight_copies(
    model: torch.nn.Module, batch: dict, precision: str = "bf16", cache_enabled: bool = True
) -> dict:
    """The 16-bit weight copies autocast saves for backward, over two forward passes in one block.

    Returns ``{"copies", "bytes", "reused"}``: how many weight matrices the first pass saved as a
    16-bit copy, their bytes, and whether the second pass saved the very same copies (autocast caches
    each cast weight until the outermost ``autocast`` block exits; ``cache_enabled=False`` turns that off).
    """
    device = next(model.parameters()).device
    batch = to_device(batch, device)
    dtype = autocast_dtype(precision)
    # the matrices: what autocast casts for matmuls
    casts = [p.detach().to(dtype) for p in model.parameters() if p.dim() == 2]

    def weight_copies(saved: SavedTensors) -> dict[int, int]:
        """Storage -> bytes of the saved tensors that are a cast weight (often as a transposed view)."""
        copies = {}
        for t in saved.tensors:
            if t.dtype == dtype and t.dim() == 2:
                for c in casts:
                    if (t.shape == c.shape and torch.equal(t, c)) or (
                        t.shape == c.T.shape and torch.equal(t, c.T)  # F.linear saves the weight transposed
                    ):
                        # by storage: a copy and its views count once
                        copies[t.untyped_storage().data_ptr()] = tensor_bytes([t])
                        break
        return copies

    passes = [SavedTensors(keep=True), SavedTensors(keep=True)]
    losses = []
    with torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache_enabled):
        for saved in passes:
            with saved:
                losses.append(model(**batch).loss)
    sum(losses).backward()  # the graphs hold every saved copy until here: no storage is reused
    model.zero_grad(set_to_none=True)
    first, second = (weight_copies(saved) for saved in passes)
    return {
        "copies": len(first),
        "bytes": sum(first.values()),
        "reused": bool(first) and set(first) == set(second),
    }


def state_dtypes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """What a training step keeps between steps, read from the tensors: dtype and bytes per parameter.

    Call after at least one ``optimizer.step()`` (AdamW creates its state lazily).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)

    def row(name: str, tensors: list[torch.Tensor]) -> dict:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        size = tensor_bytes(tensors)
        return {
            "what": name,
            "dtype": ", ".join(dtypes),
            "bytes/param": round(size / n, 2),
            "MiB": size / MIB,
        }

    state = [optimizer.state[p] for p in params if p in optimizer.state]
    rows = [
        row("weights", params),
        row("gradients", [p.grad for p in params if p.grad is not None]),
    ]
    for key in ("exp_avg", "exp_avg_sq"):
        rows.append(row(f"AdamW {key}", [s[key] for s in state if key in s]))
    return rows


def lost_update(value: float, update: float, dtype: torch.dtype) -> dict:
    """Whether ``value + update`` stored in ``dtype`` still differs from ``value`` (small updates vanish)."""
    w = torch.tensor(value, dtype=dtype)
    new = w + torch.tensor(update, dtype=dtype)  # the sum is rounded to dtype: a small update rounds away
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "before": w.item(),
        "after": new.item(),
        "lost": bool(new == w),
    }


@dataclass
class CommDemo:
    """A few SGD steps of data-parallel training per all-reduce hook, to count what each one sends."""

    # apparatus.local_sgd.HOOKS: "fp32" DDP's all-reduce, "fp16"/"bf16" compress
    hooks: tuple[str, ...] = ("fp32", "fp16")
    steps: int = 3
    global_batch: int = 8
    lr: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.hooks) - set(HOOKS)
        if unknown:
            raise ValueError(f"Unknown hook(s) {sorted(unknown)}: use {', '.join(map(repr, HOOKS))}.")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}.")


def comm_row(rank: int, hook: str, sent: CollectiveLog, steps: int, model: torch.nn.Module) -> dict:
    """What one rank's all-reduces carried per step with ``hook`` (counted in ``sent``), and its parameters."""
    return {
        "rank": rank,
        "hook": hook,
        "calls_per_step": sent.calls["all-reduce"] / steps,
        "bytes_per_step": sent.bytes["all-reduce"] / steps,
        "dtypes": sorted(sent.dtypes["all-reduce"]),
        "parameters": sum(p.numel() for p in model.parameters()),
        "params_after": flat_params(model),
    }


def comm_worker(rank: int, world_size: int, demo: CommDemo) -> list[dict]:
    """One rank: for each hook, ``demo.steps`` DDP steps from the same start, counting every all-reduce."""
    device = rank_device(rank)
    _, batch = local_batch(demo.global_batch, rank, world_size, device)  # this rank's rows
    rows = []
    for hook in demo.hooks:
        torch.manual_seed(demo.seed)  # the same start for every hook
        model = disable_dropout(models.load_model()).to(device)  # no dropout: only the hook differs
        ddp = DistributedDataParallel(model)
        # "fp32": DDP's all-reduce as a Python hook (so it is counted); "fp16": cast, all-reduce, cast back
        ddp.register_comm_hook(None, comm_hook(hook))  # state None: the default process group
        optimizer = torch.optim.SGD(model.parameters(), lr=demo.lr)
        with counting_collectives() as sent:  # what the hook hands to the network
            for _ in range(demo.steps):
                ddp(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        rows.append(comm_row(rank, hook, sent, demo.steps, model))
    return rows


def round_speedups(reference: Sequence[float], times: Sequence[float], warmup: int = 1) -> list[float]:
    """Speed per round as a multiple of ``reference``'s in the same round (interleaved rounds, warm-up dropped)."""
    return [ref / t for ref, t in zip(reference[warmup:], times[warmup:])]


def cpu_verdict_sentences(
    matmul: PrecisionAdvice, step: PrecisionAdvice, bf16_step_quartiles: tuple[float, float] | None = None
) -> list[str]:
    """Lesson 03's reading of this CPU's measurements (matmul and training step), as Japanese sentences.

    The course picks bf16 on a CPU only where its training step measured at least ``FASTER`` x fp32
    (``PrecisionAdvice.fastest``); ``bf16_step_quartiles`` (first and third quartile of the per-round
    speed-ups, ``round_speedups``) says whether the threshold lies within the spread of the rounds.
    """
    bf16_mm, bf16_step = matmul.speedups.get("bf16"), step.speedups.get("bf16")
    fp16_mm, fp16_step = matmul.speedups.get("fp16"), step.speedups.get("fp16")
    if bf16_mm is None or bf16_step is None:
        raise ValueError("Measure bf16 as well as fp32 ('no') for both the matmul and the training step.")
    threshold = f"コースが BF16 を選ぶしきい値（FP32 の {FASTER} 倍）"
    if step.fastest == "bf16":
        bf16 = (
            f"このマシンでは BF16 の学習ステップが FP32 の {bf16_step:.2f} 倍の速さで、{threshold}を超えるので、"
            "コースは BF16 の混合精度を選びます（`GradScaler` は不要です）。"
        )
    elif bf16_mm >= FASTER:
        bf16 = (
            f"このマシンでは BF16 の行列積は FP32 の {bf16_mm:.2f} 倍の速さですが、学習ステップは {bf16_step:.2f} 倍で、"
            f"{threshold}に届きません。学習ステップには行列積以外の時間（16 ビットへの型変換や小さな演算）も含まれ、"
            "同梱モデルのように行列が小さいと、その時間が行列積で節約した時間の多くを打ち消すことがあります。"
            "このマシンのこの大きさのモデルでは、コースは FP32 を選びます。"
        )
    else:
        bf16 = (
            f"このマシンでは BF16 は行列積で FP32 の {bf16_mm:.2f} 倍、学習ステップで {bf16_step:.2f} 倍の速さで、"
            f"{threshold}に届きません。コースは FP32 を選びます。"
        )
    sentences = [bf16]
    if bf16_step_quartiles is not None:
        lo, hi = bf16_step_quartiles
        where = (
            "この範囲より上にあり、ばらつきを考えても届いていません"
            if hi < FASTER
            else "この範囲より下にあり、ばらつきを考えても超えています"
            if lo >= FASTER
            else "この範囲の中にあり、判定はラウンドごとのばらつきで変わりうる近さです"
        )
        sentences.append(
            f"ラウンドごとの BF16 の学習ステップの速さ（同じラウンドの FP32 との比）は、四分位範囲で {lo:.2f}〜{hi:.2f} 倍です。"
            f"しきい値 {FASTER} 倍は{where}。"
        )
    if fp16_mm is not None and fp16_step is not None:
        sentences.append(
            f"FP16 は行列積で FP32 の {fp16_mm:.2f} 倍、学習ステップで {fp16_step:.2f} 倍の速さでした。"
            "速さにかかわらず、CPU では Accelerate と Trainer が FP16 の指定を無視し、`GradScaler` も要るので、"
            "CPU の混合精度には使いません。"
        )
    return sentences
