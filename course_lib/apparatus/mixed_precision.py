"""Lesson 03's demonstrations: the three efficiencies of mixed precision, each measured, not derived.

* memory: the activation bytes autograd saves for backward (``instruments.memory.SavedTensors``), by
  dtype, in fp32 and under autocast; what stays 32-bit (weights, gradients, AdamW state) read from the tensors;
  what casting the whole model does to weight memory, and what it costs (small updates lost); the
  16-bit weight copies autocast caches for the length of an ``autocast`` block.
* communication: the bytes DDP's all-reduce really sends per step, counted in two real processes,
  with the default hook (fp32) and with a compression hook (``fp16_compress_hook``; DDP accepts
  ``bf16_compress_hook`` only in a CUDA/ROCm build with NCCL >= 2.10 or an XPU build with XCCL, whatever the
  process group's backend: a ``+cpu`` build refuses it, see lesson 05), by ``instruments.comm``'s counter;
  the parameters after the same steps.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from course_lib.devices import to_device
from course_lib.distributed import disable_dropout, flat_params, rank_device, shard_indices
from course_lib.instruments.comm import counting_collectives
from course_lib.instruments.memory import MIB, SavedTensors, tensor_bytes
from course_lib.mixed_precision import FASTER, PrecisionAdvice, autocast_dtype


def saved_activation_bytes(model: torch.nn.Module, batch: dict, precision: str = "no") -> dict[str, int]:
    """Bytes of the tensors autograd saves for backward in one forward pass, per dtype.

    Counted by ``instruments.memory.SavedTensors`` (``saved_tensors_hooks``): every tensor packed for
    backward passes through the hook. A parameter saved as-is (a weight in fp32) is counted too, once.
    """
    device = next(model.parameters()).device
    batch = to_device(batch, device)
    ctx = (
        nullcontext()
        if precision == "no"
        else torch.autocast(device_type=device.type, dtype=autocast_dtype(precision))
    )
    with SavedTensors() as saved, ctx:
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return dict(saved.by_dtype)


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


def comm_worker(rank: int, world_size: int, demo: CommDemo) -> list[dict]:
    """One rank: for each hook, ``demo.steps`` DDP steps from the same start, counting every all-reduce.

    DDP's built-in all-reduce runs in C++; ``allreduce_hook`` is the same operation as a Python hook,
    so that every call can be counted (``instruments.comm``). The hooks are lesson 05's
    (``apparatus.local_sgd.comm_hook``). fp16's runs in any build, over gloo too; whether DDP accepts
    ``bf16_compress_hook`` depends on the PyTorch build, not on the backend (CUDA/ROCm with NCCL >= 2.10, or
    XPU with XCCL; ``apparatus.local_sgd.bf16_build_support``).
    """
    from torch.nn.parallel import DistributedDataParallel

    from course_lib import data, models
    from course_lib.apparatus.local_sgd import HOOKS, comm_hook

    unknown = set(demo.hooks) - set(HOOKS)
    if unknown:
        raise ValueError(f"Unknown hook(s) {sorted(unknown)}: use {', '.join(map(repr, HOOKS))}.")
    device = rank_device(rank)
    tokenizer = models.load_tokenizer()
    split = data.tokenize_dataset(data.load_mrpc()["train"].select(range(demo.global_batch)), tokenizer)
    rows = shard_indices(demo.global_batch, world_size, rank)
    batch = to_device(data.make_collator(tokenizer)([split[i] for i in rows]), device)
    results = []
    for name in demo.hooks:
        torch.manual_seed(demo.seed)  # the same start for every hook
        model = disable_dropout(models.load_model()).to(device)  # no dropout: only the hook differs
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, comm_hook(name))  # state None: the default process group
        optimizer = torch.optim.SGD(model.parameters(), lr=demo.lr)
        with counting_collectives() as sent:  # what the hook hands to the network
            for _ in range(demo.steps):
                ddp(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        results.append(
            {
                "rank": rank,
                "hook": name,
                "calls_per_step": sent.calls["all-reduce"] / demo.steps,
                "bytes_per_step": sent.bytes["all-reduce"] / demo.steps,
                "dtypes": sorted(sent.dtypes["all-reduce"]),
                "parameters": sum(p.numel() for p in model.parameters()),
                "params_after": flat_params(model),
            }
        )
    return results


def cpu_verdict_sentences(matmul: PrecisionAdvice, step: PrecisionAdvice) -> list[str]:
    """Lesson 03's reading of this CPU's measurements (matmul and training step), as Japanese sentences."""
    bf16_mm, bf16_step = matmul.speedups.get("bf16"), step.speedups.get("bf16")
    fp16_mm, fp16_step = matmul.speedups.get("fp16"), step.speedups.get("fp16")
    if bf16_mm is None or bf16_step is None:
        raise ValueError("Measure bf16 as well as fp32 ('no') for both the matmul and the training step.")
    if step.fastest == "bf16":
        bf16 = (
            f"このマシンでは BF16 の学習ステップが FP32 の {bf16_step:.2f} 倍の速さで、"
            "BF16 の混合精度が得です（`GradScaler` は不要です）。"
        )
    elif bf16_mm >= FASTER:
        bf16 = (
            f"このマシンでは BF16 の行列積は FP32 の {bf16_mm:.2f} 倍の速さですが、学習ステップは {bf16_step:.2f} 倍で、"
            "得になっていません。学習ステップには行列積以外の時間（16 ビットへの型変換や小さな演算）も含まれ、"
            "同梱モデルのように行列が小さいと、その時間が行列積で節約した時間を上回ることがあります。"
            "このマシンのこの大きさのモデルでは FP32 のままにします。"
        )
    else:
        bf16 = (
            f"このマシンでは BF16 は行列積で FP32 の {bf16_mm:.2f} 倍、学習ステップで {bf16_step:.2f} 倍の速さで、"
            "FP32 より速くありません。FP32 のままが最速です。"
        )
    sentences = [bf16]
    if fp16_mm is not None and fp16_step is not None:
        sentences.append(
            f"FP16 は行列積で FP32 の {fp16_mm:.2f} 倍、学習ステップで {fp16_step:.2f} 倍の速さでした。"
            "速さにかかわらず、CPU では Accelerate と Trainer が FP16 の指定を無視し、`GradScaler` も要るので、"
            "CPU の混合精度には使いません。"
        )
    return sentences
