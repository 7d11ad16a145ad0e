"""Devices: pick the accelerator, describe the machine, move batches, seed everything.

Which precision to train in is ``course_lib.mixed_precision``'s business.
"""

from __future__ import annotations

import os
import platform
import random
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

DEVICE_TYPES = ("cuda", "mps", "cpu")


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


# The feature flags the course reports (Linux /proc/cpuinfo names; other systems report none):
# x86 "flags" and ARM "Features" (bf16: BF16 matmul instructions; asimdhp: FP16 arithmetic, shown only).
CPU_FEATURES = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_fp16",
    "amx_tile",
    "bf16",
    "asimdhp",
)


@lru_cache(maxsize=1)  # read /proc/cpuinfo once per process
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """CPU feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                # x86 lists them as "flags", ARM (Graviton, Ampere, a Raspberry Pi) as "Features"
                if line.startswith(("flags", "Features")):
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


def describe_machine() -> dict[str, Any]:
    """Versions, CPU model and features, GPU name/memory/capability, and the device to train on."""
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
        "cpu_features": sorted(f for f in CPU_FEATURES if f in flags),
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
    info["device"] = str(get_device())
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


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (all devices), and the hash seed of child processes."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy accepts seeds in [0, 2**32) only
    torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    # str hashing of this process was fixed at its start; this seeds only the processes it starts later
    os.environ["PYTHONHASHSEED"] = str(seed)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested) dict/list/tuple batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)  # asynchronous only from pinned memory, else a plain copy
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))  # a namedtuple takes its fields one by one
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)  # a list stays a list, a tuple a tuple
    return batch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU): call before reading a timer."""
    # None: the device get_device() picks
    device = get_device(device) if not isinstance(device, torch.device) else device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def one_trainer_device(args: Any) -> Any:
    """Keep a ``transformers.TrainingArguments`` on one device; returns ``args``.

    On one process with several GPUs, Trainer (transformers 5.24) counts them all (``args.n_gpu =
    torch.cuda.device_count()``), wraps the model in ``nn.DataParallel`` and trains ``per_device x
    n_gpu`` rows a micro-batch. The lessons compare Trainer's windows of rows with their own loops, so
    they keep it on ``cuda:0``, as ``CUDA_VISIBLE_DEVICES=0`` would. Under ``torchrun`` (one GPU per
    process) and on a CPU there is nothing to change.
    """
    if args.n_gpu > 1:  # reading n_gpu sets the device up first
        args._n_gpu = 1  # the attribute n_gpu reads; TrainingArguments has no argument for it
    return args
