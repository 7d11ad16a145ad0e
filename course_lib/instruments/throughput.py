"""Throughput, defined once: matmul GFLOP/s (this machine's peak), model FLOPs per token, MFU.

tokens/s is padded tokens of a step over its ``Stopwatch`` time (``History.tokens_per_s``); MFU is the
model's training FLOPs per second over the matmul peak measured here in the dtype it computed in.
"""

from __future__ import annotations

from typing import Any

import torch

from course_lib.devices import get_device
from course_lib.instruments.timing import Timing, time_fn


def matmul_gflops(
    dtype: torch.dtype = torch.float32,
    device=None,
    n: int | None = None,
    repeat: int = 5,
    target_s: float = 0.02,
    max_n: int = 2048,
) -> dict[str, float]:
    """Achieved GFLOP/s of an ``n x n`` matmul in ``dtype`` on ``device`` (``2 n^3`` FLOPs a call).

    With ``n=None`` the size grows from 128 until one call takes ``target_s`` or ``n`` reaches
    ``max_n``, so a slow path (fp16 on most CPUs) is measured in well under a second.
    """
    device = get_device(device)

    def measure(size: int) -> Timing:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        return time_fn(lambda: a @ b, warmup=1, repeat=repeat, device=device)

    if n is None:
        n = 128
        timing = measure(n)
        while timing.median < target_s and n < max_n:
            n *= 2
            timing = measure(n)
    else:
        timing = measure(n)
    # n^3 multiply-adds, 2 FLOPs each
    return {"n": n, "seconds": timing.median, "gflops": 2 * n**3 / timing.median / 1e9}


def model_flops_per_token(n_params: int, n_layers: int = 0, d_model: int = 0, seq_len: int = 0) -> float:
    """Training FLOPs per token of a dense transformer (PaLM, Chowdhery et al. 2022, appendix B).

    ``6 N`` for the weights' matmuls (forward 2N + backward 4N; N without embedding tables) plus
    ``12 x n_layers x d_model x seq_len`` for attention's score and value products, which hold no
    weights. Checked against ``torch.utils.flop_counter`` in tests/test_bench.py.
    """
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s as a fraction of the measured matmul peak."""
    return tokens_per_s * flops_per_token / (peak_gflops * 1e9)


def per_process_throughput(history, rows_per_step: int, accelerator) -> dict[str, Any]:
    """Padded tokens/s and samples/s of every process (median over optimizer steps) and their sum.

    ``history`` is this process's ``training.History``; a collective: every process calls it.
    """
    from accelerate.utils import gather

    step_s = history.median_step_time()
    mine = torch.tensor(
        [history.tokens_per_s(), rows_per_step / step_s, step_s],
        dtype=torch.float64,  # tokens/s pass the gather unrounded
        device=accelerator.device,  # nccl gathers CUDA tensors only
    )
    rows = gather(mine.unsqueeze(0)).cpu().tolist()  # (processes, 3)
    return {
        "tokens_per_s": [r[0] for r in rows],
        "samples_per_s": [r[1] for r in rows],
        "median_step_s": [r[2] for r in rows],
        "total_tokens_per_s": sum(r[0] for r in rows),
        "total_samples_per_s": sum(r[1] for r in rows),
    }


def format_per_process(tp: dict[str, Any]) -> str:
    """``per_process_throughput``'s figures: one line per process, then the total."""
    lines = [
        f"  rank {r}: {tok:,.0f} tokens/s, {smp:,.1f} samples/s, {s * 1000:.0f} ms/step"
        for r, (tok, smp, s) in enumerate(zip(tp["tokens_per_s"], tp["samples_per_s"], tp["median_step_s"]))
    ]
    lines.append(
        f"  total : {tp['total_tokens_per_s']:,.0f} tokens/s, {tp['total_samples_per_s']:,.1f} samples/s"
    )
    return "\n".join(lines)
