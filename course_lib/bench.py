"""Benchmarking primitives: time a step properly, matmul throughput, peak memory.

Rules kept here (see d2l's ``Benchmark`` for the trap we avoid): warm up first, synchronise the
device before reading the clock, report the median of several repeats, and say which machine
the numbers come from.

The benchmark command built on these (``python -m course_lib.bench``; flags: ``--help``; how to read
it: docs/benchmark.md) lives in ``course_lib.bench_harness``.

Peak memory:
* CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) around the work.
* CPU: there is no allocator counter, so the work runs in a *fresh* Python subprocess and we report
  that process's peak resident set size minus its resident size just before the work started
  (after imports and set-up). This counts real memory the work touched. The peak is the kernel's
  ``VmHWM`` high-water mark, reset to the current size just before the work (``/proc/self/clear_refs``)
  so set-up peaks do not count. Not ``ru_maxrss``: Linux carries the *parent's* peak into a
  forked child, so a child of a big process would report the parent's size.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.devices import get_device, synchronize


@dataclass
class Timing:
    """Seconds per call: the median and every repeat."""

    median: float
    times: list[float]

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.times) - min(self.times)) / self.median if self.median else float("nan")


def time_fn(fn: Callable[[], object], warmup: int = 2, repeat: int = 5, device=None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` synchronised, timed calls."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}.")
    device = get_device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), times)


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


def cuda_peak_mb(fn: Callable[[], object], device=None) -> float:
    """Peak CUDA memory (MiB) allocated while ``fn()`` runs, above what was allocated before."""
    device = get_device(device)
    if device.type != "cuda":
        raise ValueError("cuda_peak_mb measures CUDA memory: use peak_rss_mb_subprocess on a CPU.")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


_CHILD = r"""
import importlib, json, resource, sys
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
def hwm_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError("no VmHWM in /proc/self/status")
spec = json.loads(sys.argv[1])
module, _, name = spec["target"].partition(":")
fn = getattr(importlib.import_module(module), name)
setup = fn(**spec["kwargs"])        # returns a zero-argument callable: the work to measure
before = rss_mb()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                # reset the high-water mark to the current RSS (Linux 4.0+)
    reset = True
except OSError:
    reset = False                   # then the peak may include set-up's own peak
result = setup()
peak = hwm_mb()
print("__RESULT__" + json.dumps({"before_mb": before, "peak_mb": peak, "peak_reset": reset, "result": result}))
"""


def peak_rss_mb_subprocess(target: str, timeout: float = 600, **kwargs) -> dict:
    """Run ``target`` (``"module:function"``) in a fresh Python and measure its peak RSS (Linux).

    ``function(**kwargs)`` must do its set-up (imports, model, data) and return a zero-argument
    callable that does the work and returns something JSON-serialisable. Returns
    ``{"before_mb", "peak_mb", "work_mb", "peak_reset", "result"}`` where
    ``work_mb = peak_mb - before_mb`` (``peak_reset`` False: the kernel could not reset the
    high-water mark, so ``peak_mb`` may include the set-up's own peak).
    """
    if not sys.platform.startswith("linux"):
        raise OSError("peak_rss_mb_subprocess reads /proc: it needs Linux. Use --no-memory elsewhere.")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps({"target": target, "kwargs": kwargs})],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("__RESULT__")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{target} failed in the measuring subprocess:\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("__RESULT__") :])
    out["work_mb"] = max(0.0, out["peak_mb"] - out["before_mb"])
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.bench``: the training benchmark (see ``course_lib.bench_harness``)."""
    from course_lib.bench_harness import main as harness_main

    return harness_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
