"""Devices: pick the accelerator, describe the machine, choose a precision, seed everything."""

from __future__ import annotations

import os
import platform
import random
import warnings
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

PRECISIONS = ("no", "fp16", "bf16")
_ALIASES = {"fp32": "no", "float32": "no", "none": "no", "float16": "fp16", "bfloat16": "bf16"}
DEVICE_TYPES = ("cuda", "mps", "cpu")


class PrecisionWarning(UserWarning):
    """A requested precision will be slow, or silently do nothing, on this device."""


def get_device(name: str | torch.device | None = None) -> torch.device:
    """The device to train on: ``name`` if given, else cuda, then mps, then cpu."""
    if isinstance(name, torch.device):
        name = str(name)
    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind not in DEVICE_TYPES:
        raise ValueError(f"Unknown device {name!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"Device {name!r} was requested but CUDA is not available on this machine. "
            "Use get_device() (auto) or 'cpu'."
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("Device 'mps' was requested but is not available here. Use 'cpu'.")
    return torch.device(name)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    """The CPU's model name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 instructions (AVX512-BF16 or AMX), or is Apple/ARM bf16."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags) or "bf16" in flags


def cpu_has_fast_fp16() -> bool:
    """True when the CPU has native fp16 arithmetic (AVX512-FP16 or AMX-FP16); most CPUs do not."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags())


def describe_machine() -> dict[str, Any]:
    """Versions, CPU model and features, GPU name/memory/capability, and fast precisions."""
    import accelerate
    import transformers

    flags = cpu_flags()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_features": sorted(
            f
            for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")
            if f in flags
        ),
        "cuda_available": torch.cuda.is_available(),
        "mps_available": torch.backends.mps.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "name": p.name,
                    "memory_gb": round(p.total_memory / 2**30, 1),
                    "compute_capability": f"{p.major}.{p.minor}",
                }
            )
    device = get_device()
    info["device"] = str(device)
    info["best_precision"] = best_precision(device)
    return info


def format_machine(info: Mapping[str, Any] | None = None) -> str:
    """``describe_machine()`` as aligned ``key: value`` lines."""
    info = describe_machine() if info is None else info
    lines = []
    for key, value in info.items():
        if key == "gpus":
            value = (
                "; ".join(f"{g['name']} ({g['memory_gb']} GB, cc {g['compute_capability']})" for g in value)
                or "none"
            )
        elif isinstance(value, list):
            value = ", ".join(value) or "none"
        lines.append(f"{key:>15}: {value}")
    return "\n".join(lines)


def normalize_precision(precision: str | None) -> str:
    """``"no"``, ``"fp16"`` or ``"bf16"`` (accepts aliases such as ``"fp32"``, ``"bfloat16"``)."""
    p = "no" if precision is None else str(precision).strip().lower()
    p = _ALIASES.get(p, p)
    if p not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}: use 'no' (fp32), 'fp16' or 'bf16'.")
    return p


def best_precision(device: torch.device | str | None = None, measure: bool = False) -> str:
    """The mixed precision worth using on ``device``: bf16 where native, fp16 on older GPUs, else no.

    On a CPU the flags only say bf16 *instructions* exist (AVX512-BF16/AMX); whether they beat fp32
    depends on the chip (AMX, or AVX512-BF16 on AMD Zen 4: yes; AVX512-BF16 alone on some Intel
    VMs: no). With ``measure=True`` a quick matmul test (under a second) decides: bf16 only if it
    runs at least 1.2x the fp32 GFLOP/s here.
    """
    device = get_device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16"
        return "fp16" if major >= 7 else "no"
    if device.type == "mps":
        return "fp16"
    if not cpu_has_fast_bf16():
        return "no"
    if measure:
        from course_lib.bench import matmul_gflops

        fp32 = matmul_gflops(torch.float32, device, n=512)["gflops"]
        bf16 = matmul_gflops(torch.bfloat16, device, n=512)["gflops"]
        return "bf16" if bf16 >= 1.2 * fp32 else "no"
    return "bf16"


def check_precision(precision: str | None, device: torch.device | str | None = None) -> str:
    """Normalise ``precision`` and warn if it will be slow or silently ignored on ``device``."""
    p = normalize_precision(precision)
    device = get_device(device)
    if p == "fp16" and device.type == "cpu":
        speed = (
            "this CPU has AVX512-FP16, so fp16 matmuls are native here, but"
            if cpu_has_fast_fp16()
            else "on CPUs without AVX512-FP16 (most) fp16 matmuls run far slower than fp32, and"
        )
        warnings.warn(
            f"fp16 on a CPU is a trap: {speed} Accelerator(mixed_precision='fp16') / "
            "TrainingArguments(fp16=True) silently train in fp32 on a CPU. Use precision='bf16' "
            "(the CPU's mixed precision) or 'no'.",
            PrecisionWarning,
            stacklevel=2,
        )
    elif p == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        warnings.warn(
            "This CPU has no native bf16 instructions (AVX512-BF16/AMX): bf16 autocast is emulated "
            "and may be slower than fp32. Consider precision='no'.",
            PrecisionWarning,
            stacklevel=2,
        )
    elif p == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        warnings.warn(
            "This GPU has no native bf16 support (needs compute capability 8.0+): use 'fp16'.",
            PrecisionWarning,
            stacklevel=2,
        )
    return p


def autocast_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes in for ``precision`` (float32 for ``"no"``)."""
    return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        normalize_precision(precision)
    ]


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested) dict/list/tuple batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def check_same_device(model: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise a clear error if any tensor in ``batch`` is not on the model's device."""
    model_device = next(model.parameters()).device
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device != model_device:
            raise RuntimeError(
                f"Batch tensor {key!r} is on {value.device} but the model is on {model_device}. "
                f"Move the batch first: batch = to_device(batch, {str(model_device)!r})."
            )


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU): call before reading a timer."""
    device = get_device(device) if not isinstance(device, torch.device) else device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
