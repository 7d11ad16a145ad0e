"""Mixed precision policy: one vocabulary of precision names, their dtypes, and which one to use here.

The names are Accelerate's (``Accelerator(mixed_precision=...)``): ``"no"`` (fp32), ``"fp16"``,
``"bf16"``. ``PRECISIONS`` maps each to the dtype autocast computes in and the label tables print;
aliases such as ``"fp32"`` or ``"bfloat16"`` are accepted on input, read from the one table of dtype
names in ``course_lib.floats``, where the float formats themselves (bits, ranges, underflow) are
teaching material.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from course_lib.devices import cpu_flags, get_device
from course_lib.floats import FORMATS, format_name


@dataclass(frozen=True)
class Precision:
    """One training precision: its name, the label tables show, the autocast dtype, loss scaling."""

    name: str
    label: str
    dtype: torch.dtype
    needs_scaler: bool


PRECISIONS = {
    "no": Precision("no", "fp32", FORMATS["fp32"], needs_scaler=False),
    "fp16": Precision("fp16", "fp16", FORMATS["fp16"], needs_scaler=True),
    "bf16": Precision("bf16", "bf16", FORMATS["bf16"], needs_scaler=False),
}


class PrecisionWarning(UserWarning):
    """A requested precision will be slow, or silently do nothing, on this device."""


def normalize_precision(precision: str | None) -> str:
    """``"no"``, ``"fp16"`` or ``"bf16"``: also ``"none"`` and a float format's name or alias (``"fp32"``,
    ``"bfloat16"``, ``"half"``: ``floats.format_name``, the one table of dtype names)."""
    p = "no" if precision is None else str(precision).strip().lower()
    if p in ("no", "none"):
        return "no"
    try:
        label = format_name(p)
    except ValueError:
        # from None: format_name's error offers float formats, not Accelerate's precision names
        raise ValueError(f"Unknown precision {precision!r}: use 'no' (fp32), 'fp16' or 'bf16'.") from None
    # "fp32" maps back to Accelerate's "no"
    return next(name for name, spec in PRECISIONS.items() if spec.label == label)


FASTER, SLOWER = 1.15, 0.87  # measured speed vs fp32 above / below which a format is "faster" / "slower"


def _usable(device_type: str, capability: tuple[int, int] | None) -> dict[str, str]:
    """Precisions that cannot train well on this kind of device, and why (fp32 always can)."""
    why: dict[str, str] = {}
    if device_type == "cpu":
        why["fp16"] = "CPU では Accelerate と Trainer が FP16 の指定を黙って無視し、FP32 で学習します"
    elif device_type == "cuda" and capability is not None and capability[0] < 8:
        why["bf16"] = (
            f"BF16 には compute capability 8.0 以上の GPU が必要です（この GPU は {capability[0]}.{capability[1]}）"
        )
    elif device_type == "mps":
        why["bf16"] = "Apple の GPU の BF16 autocast は新しく対応が不完全なので、コースは FP16 を使います"
    return why


@dataclass(frozen=True)
class PrecisionAdvice:
    """Which precision to train in on one device, decided from measured matmul speeds.

    ``speedups`` maps each measured precision to its matmul speed as a multiple of fp32's.
    ``fastest`` is the usable precision measured at least ``FASTER`` x fp32 (fp32 when none is);
    ``safe_default`` is what to start with: fp32 on a CPU unless bf16 measured faster, bf16 on a GPU
    that has it, fp16 with a GradScaler on an older GPU or Apple's.
    """

    device_type: str
    speedups: dict[str, float]
    unusable: dict[str, str]
    fastest: str
    safe_default: str

    def verdict(self, precision: str) -> str:
        """One Japanese phrase for the lessons: faster / slower / about as fast as fp32 here, or why not used."""
        p = normalize_precision(precision)
        label = PRECISIONS[p].label.upper()
        if p == "no":
            return "FP32: 基準"
        speed = self.speedups.get(p)
        measured = (
            ""
            if speed is None
            else (
                f"FP32 の {speed:.2f} 倍（このマシンでは速い）"
                if speed >= FASTER
                else f"FP32 の {speed:.2f} 倍（このマシンでは遅い）"
                if speed <= SLOWER
                else f"FP32 の {speed:.2f} 倍（このマシンでは FP32 とほぼ同じ）"
            )
        )
        if p in self.unusable:
            return f"{label}: {measured + '。' if measured else ''}このマシンではトレーニングに使いません（{self.unusable[p]}）"
        return f"{label}: {measured or '未計測'}"

    def summary(self) -> str:
        """The verdict of every precision, the precision the course picks (``fastest``: at least ``FASTER``
        x fp32, else fp32) and the safe default, as Japanese lines of text."""
        lines = [self.verdict(p) for p in PRECISIONS if p == "no" or p in self.speedups or p in self.unusable]
        lines.append(
            f"コースが選ぶ精度（FP32 の {FASTER} 倍以上速いもののうち最速、なければ FP32）: "
            f"{PRECISIONS[self.fastest].label.upper()}"
        )
        lines.append(f"このマシンの既定: {PRECISIONS[self.safe_default].label.upper()}")
        return "\n".join(lines)


def advise_precision(
    device_type: str, gflops: Mapping[str, float], capability: tuple[int, int] | None = None
) -> PrecisionAdvice:
    """``PrecisionAdvice`` from measured matmul GFLOP/s per precision name (``"no"`` must be there).

    Pure: pass measurements (``measure_matmul``) or made-up numbers (tests of every kind of machine).
    """
    gflops = {normalize_precision(k): v for k, v in gflops.items()}
    if "no" not in gflops or gflops["no"] <= 0:
        raise ValueError("advise_precision needs the fp32 ('no') GFLOP/s to compare against.")
    speedups = {p: g / gflops["no"] for p, g in gflops.items() if p != "no"}
    unusable = _usable(device_type, capability)
    candidates = [p for p, s in speedups.items() if p not in unusable and s >= FASTER]
    fastest = max(candidates, key=speedups.get) if candidates else "no"
    if device_type == "cpu":
        safe = "bf16" if fastest == "bf16" else "no"  # on a CPU, bf16 only where it measured faster
    elif "bf16" not in unusable and device_type == "cuda":
        safe = "bf16"
    else:
        safe = "fp16"
    return PrecisionAdvice(device_type, speedups, unusable, fastest, safe)


def measure_matmul(device: torch.device | str | None = None) -> dict[str, float]:
    """Matmul GFLOP/s of each precision that autocast can use on ``device`` (under a second on a CPU)."""
    from course_lib.instruments.throughput import matmul_gflops

    device = get_device(device)
    n = 512 if device.type == "cpu" else None  # 512: under a second on a CPU; None: matmul_gflops' GPU size
    return {p: matmul_gflops(PRECISIONS[p].dtype, device, n=n)["gflops"] for p in PRECISIONS}


def advise(device: torch.device | str | None = None) -> PrecisionAdvice:
    """Measure this device's matmul speed in each precision and advise (``advise_precision``)."""
    device = get_device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return advise_precision(device.type, measure_matmul(device), capability)


BF16_GPU_MAJOR = 8  # compute capability from which a GPU computes bf16 natively (Ampere)


def gpu_has_native_bf16(device: torch.device | str = "cuda") -> bool:
    """Whether the GPU ``device`` computes bf16 natively: compute capability 8.0+ (A100, H100, RTX 30xx+)."""
    # not torch.cuda.is_bf16_supported(): it asks the *current* GPU, and by default says True on 7.x,
    # which only emulates bf16 (slowly)
    return torch.cuda.get_device_capability(device)[0] >= BF16_GPU_MAJOR


def best_precision(device: torch.device | str | None = None, measure: bool | None = None) -> str:
    """The mixed precision worth using on ``device``; ``"no"`` (fp32) where none pays.

    GPUs: bf16 from compute capability 8.0 (A100, H100, RTX 30xx+), fp16 on 7.x, else no; Apple:
    fp16. CPUs: the flags only say bf16 *instructions* exist (AVX512-BF16/AMX); whether they beat
    fp32 depends on the chip (AMX or AMD Zen 4: yes; AVX512-BF16 alone on some Intel VMs: no), so on
    a CPU with them a quick matmul test decides (``measure=None``, the default, or True): bf16 only
    if it runs at least ``FASTER`` x the fp32 GFLOP/s here. ``measure=False`` trusts the flags.
    """
    device = get_device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "bf16" if major >= BF16_GPU_MAJOR else "fp16" if major >= 7 else "no"
    if device.type == "mps":
        return "fp16"
    if not cpu_has_fast_bf16():
        return "no"
    if measure is False:
        return "bf16"
    from course_lib.instruments.throughput import matmul_gflops

    fp32 = matmul_gflops(torch.float32, device, n=512)["gflops"]
    bf16 = matmul_gflops(torch.bfloat16, device, n=512)["gflops"]
    return advise_precision("cpu", {"no": fp32, "bf16": bf16}).fastest


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
    elif p == "bf16" and device.type == "cuda" and not gpu_has_native_bf16(device):
        warnings.warn(
            "This GPU has no native bf16 support (needs compute capability 8.0+): use 'fp16'.",
            PrecisionWarning,
            stacklevel=2,
        )
    return p


def autocast_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes in for ``precision`` (float32 for ``"no"``)."""
    return PRECISIONS[normalize_precision(precision)].dtype


def precision_label(precision: str) -> str:
    """``"fp32"``, ``"fp16"`` or ``"bf16"``: the name a table prints for ``precision``."""
    return PRECISIONS[normalize_precision(precision)].label


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 instructions (AVX512-BF16 or AMX), or is Apple/ARM bf16."""
    flags = cpu_flags()
    # "bf16": ARM's name for its BF16 instructions (the "Features" line of /proc/cpuinfo)
    return bool({"avx512_bf16", "amx_bf16"} & flags) or "bf16" in flags


def cpu_has_fast_fp16() -> bool:
    """True when the CPU has native fp16 arithmetic (AVX512-FP16 or AMX-FP16); most CPUs do not."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags())
