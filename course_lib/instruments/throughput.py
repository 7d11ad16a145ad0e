"""Throughput, defined once: matmul GFLOP/s (this machine's peak), model FLOPs per token, MFU.

tokens/s is padded tokens of a step over its ``Stopwatch`` time (``History.tokens_per_s``); MFU is the
model's training FLOPs per second over the matmul peak measured here in the dtype it computed in.
"""

from __future__ import annotations

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
    return {"n": n, "seconds": timing.median, "gflops": 2 * n**3 / timing.median / 1e9}


def model_flops_per_token(n_params: int) -> float:
    """Training FLOPs per token of a dense transformer: ``6 N`` (forward 2N + backward 4N)."""
    return 6.0 * n_params


def mfu(tokens_per_s: float, flops_per_token: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s as a fraction of the measured matmul peak."""
    return tokens_per_s * flops_per_token / (peak_gflops * 1e9)
