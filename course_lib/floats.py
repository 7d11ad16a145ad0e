"""Floating-point formats, taught: bit layouts, range, rounding, gradient underflow (lesson 03).

Every fact here is read from torch (``torch.finfo``, bit patterns of real tensors), never typed in:

* ``format_info`` / ``format_table``: bits, max, smallest normal and subnormal, eps of each format.
* ``float_bits`` / ``rounding`` / ``describe_number``: how one number is stored in each format, what it
  rounds to, and whether it underflows (becomes 0) or overflows (becomes inf).
* ``fp32_gradients`` / ``underflow_stats`` / ``grad_log2_hist`` / ``plot_grad_hist``: which share of a
  real model's gradients would vanish in fp16, with and without loss scaling.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from course_lib.tables import align_columns

FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {
    "float32": "fp32",
    "float": "fp32",
    "single": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}
_INT_VIEW = {32: torch.int32, 16: torch.int16}


# ---------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------


def format_name(fmt: str | torch.dtype) -> str:
    """``"fp32"``, ``"fp16"`` or ``"bf16"`` for a name (``"float16"``, ``"half"`` ...) or a dtype."""
    if isinstance(fmt, torch.dtype):
        for name, dtype in FORMATS.items():
            if dtype == fmt:
                return name
        raise ValueError(
            f"{fmt} is not one of the formats of this lesson: use torch.float32/float16/bfloat16."
        )
    key = str(fmt).strip().lower().removeprefix("torch.")
    key = _DTYPE_NAMES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"Unknown float format {fmt!r}: use 'fp32', 'fp16' or 'bf16' (or a torch dtype).")
    return key


def format_dtype(fmt: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a format name or dtype."""
    return FORMATS[format_name(fmt)]


@dataclass(frozen=True)
class FormatInfo:
    """Layout and range of one floating-point format (all values from ``torch.finfo``)."""

    name: str
    dtype: torch.dtype
    bits: int
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # distance from 1.0 to the next larger number
    decimal_digits: int  # about how many significant decimal digits survive


def smallest_subnormal(fmt: str | torch.dtype) -> float:
    """The smallest positive number ``fmt`` can hold: the bit pattern ``0...01``."""
    dtype = format_dtype(fmt)
    one = torch.ones(1, dtype=_INT_VIEW[torch.finfo(dtype).bits])
    return one.view(dtype).item()


def format_info(fmt: str | torch.dtype) -> FormatInfo:
    """Bit layout, range and precision of ``fmt`` (``"fp32"``, ``"fp16"``, ``"bf16"``)."""
    name = format_name(fmt)
    dtype = FORMATS[name]
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))  # eps = 2**-mantissa_bits
    exponent = fi.bits - 1 - mantissa  # one sign bit; the rest is exponent
    return FormatInfo(
        name=name,
        dtype=dtype,
        bits=fi.bits,
        sign_bits=1,
        exponent_bits=exponent,
        mantissa_bits=mantissa,
        exponent_bias=2 ** (exponent - 1) - 1,
        max=fi.max,
        smallest_normal=fi.smallest_normal,
        smallest_subnormal=smallest_subnormal(dtype),
        eps=fi.eps,
        decimal_digits=round(-math.log10(fi.resolution)),
    )


def format_table(formats: Iterable[str | torch.dtype] = ("fp32", "fp16", "bf16")) -> list[FormatInfo]:
    """``format_info`` of each format, in order."""
    return [format_info(f) for f in formats]


def _pow2(x: float) -> str:
    """``x`` with its power of two, e.g. ``6.104e-05 (2^-14)``; ``≈`` when not an exact power."""
    e = math.log2(x)
    exact = e == round(e)
    return f"{x:.5g} (2^{round(e)})" if exact else f"{x:.5g} (≈2^{e:.3g})"


def render_format_table(formats: Iterable[str | torch.dtype] = ("fp32", "fp16", "bf16")) -> str:
    """The format table as aligned text: bits, max, smallest normal/subnormal, eps, digits."""
    header = (
        "format",
        "bits",
        "sign",
        "exponent",
        "mantissa",
        "max",
        "smallest normal",
        "smallest subnormal",
        "eps",
        "digits",
    )
    rows = [header]
    for f in format_table(formats):
        rows.append(
            (
                f.name,
                str(f.bits),
                str(f.sign_bits),
                str(f.exponent_bits),
                str(f.mantissa_bits),
                _pow2(f.max),
                _pow2(f.smallest_normal),
                _pow2(f.smallest_subnormal),
                _pow2(f.eps),
                f"~{f.decimal_digits}",
            )
        )
    return align_columns(rows)


# ---------------------------------------------------------------------------------------------------
# One number in each format
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BitFields:
    """The stored bit pattern of one value, split into sign / exponent / mantissa strings."""

    sign: str
    exponent: str
    mantissa: str

    def __str__(self) -> str:
        return f"{self.sign} {self.exponent} {self.mantissa}"


def _store(x: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` converted by torch to ``dtype`` (round to nearest even), shape (1,)."""
    return torch.tensor([float(x)], dtype=torch.float64).to(dtype)  # via float64: one rounding, into dtype


def float_bits(x: float, fmt: str | torch.dtype) -> BitFields:
    """Sign, exponent and mantissa bits of ``x`` as stored in ``fmt`` (after rounding)."""
    info = format_info(fmt)
    raw = _store(x, info.dtype).view(_INT_VIEW[info.bits]).item() & ((1 << info.bits) - 1)  # as unsigned
    b = format(raw, f"0{info.bits}b")
    return BitFields(b[0], b[1 : 1 + info.exponent_bits], b[1 + info.exponent_bits :])


@dataclass(frozen=True)
class Rounding:
    """What ``fmt`` makes of ``x``: the stored value, its error and what kind of number it is."""

    x: float
    format: str
    stored: float
    abs_error: float
    rel_error: float
    status: str  # zero | normal | subnormal | underflow | overflow | inf | nan
    bits: BitFields

    @property
    def exact(self) -> bool:
        return self.stored == self.x or (math.isnan(self.x) and math.isnan(self.stored))


def classify(x: float, stored: float, info: FormatInfo) -> str:
    """``zero``, ``normal``, ``subnormal``, ``underflow`` (nonzero -> 0), ``overflow`` (finite -> inf)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "zero"
    if stored == 0:
        return "underflow"
    if math.isinf(stored):
        return "overflow"
    return "subnormal" if abs(stored) < info.smallest_normal else "normal"


def rounding(x: float, fmt: str | torch.dtype) -> Rounding:
    """Store ``x`` in ``fmt``: stored value, absolute/relative error, status and bits."""
    try:
        x = float(x)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{x!r} is not a number: pass a float such as 1e-8 or 65504.") from err
    info = format_info(fmt)
    stored = _store(x, info.dtype).item()
    if math.isfinite(x) and math.isfinite(stored):
        abs_err = abs(stored - x)
        rel_err = abs_err / abs(x) if x else 0.0
    else:
        kept = stored == x or (math.isnan(x) and math.isnan(stored))  # inf or nan kept (nan != nan)
        abs_err = rel_err = 0.0 if kept else math.inf  # kept: no error; finite -> inf: unbounded
    return Rounding(
        x, info.name, stored, abs_err, rel_err, classify(x, stored, info), float_bits(x, info.dtype)
    )


_STATUS_TEXT = {  # Japanese for the lesson; UNDERFLOW / OVERFLOW stay the words a reader scans for
    "zero": "ゼロ",
    "normal": "OK（正規化数）",
    "subnormal": "非正規化数: 精度が落ちる",
    "underflow": "UNDERFLOW → 0（アンダーフロー）",
    "overflow": "OVERFLOW → inf（オーバーフロー）",
    "inf": "inf",
    "nan": "nan",
}


def describe_number(
    x: float, scale: float = 1.0, formats: Iterable[str | torch.dtype] = ("fp32", "fp16", "bf16")
) -> str:
    """A text table: how each format stores ``x * scale`` (bits, stored value, error, status)."""
    value = float(x) * float(scale)
    title = f"x = {float(x):.6g}" + (f" x scale {float(scale):g} = {value:.6g}" if scale != 1 else "")
    rows = [("format", "sign exponent mantissa", "stored value", "rel. error", "status")]
    for fmt in formats:
        r = rounding(value, fmt)
        rows.append((r.format, str(r.bits), f"{r.stored:.8g}", f"{r.rel_error:.2g}", _STATUS_TEXT[r.status]))
    return f"{title}\n{align_columns(rows)}"


# ---------------------------------------------------------------------------------------------------
# Gradients: which share would underflow in fp16, with and without loss scaling
# ---------------------------------------------------------------------------------------------------


def fp32_gradients(model: torch.nn.Module, batch: Mapping[str, Any], loss_factor: float = 1.0) -> dict:
    """fp32 gradients of ``loss * loss_factor`` on ``batch``: ``{name: grad}`` (each like its param)."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    (out.loss.float() * loss_factor).backward()  # fp32 loss: the factor itself must not overflow
    # clone: for fp32 CPU parameters .float().cpu() return the gradient itself
    grads = {
        n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    if not grads:
        raise ValueError("The model produced no gradients: are its parameters frozen (requires_grad=False)?")
    return grads


def _flat(grads: torch.Tensor | Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> torch.Tensor:
    """All gradient values as one flat fp32 tensor, shape (N,)."""
    if isinstance(grads, torch.Tensor):
        tensors = [grads]
    elif isinstance(grads, Mapping):
        tensors = list(grads.values())
    else:
        tensors = list(grads)
    if not tensors:
        raise ValueError(
            "No gradients given: pass a tensor, a list of tensors or fp32_gradients(model, batch)."
        )
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def underflow_stats(
    grads: torch.Tensor | Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
    fmt: str | torch.dtype = "fp16",
    scale: float = 1.0,
) -> dict[str, Any]:
    """Cast ``grads * scale`` to ``fmt`` and count what the cast destroys.

    ``underflow``: nonzero values that become 0; ``subnormal``: values that survive only as
    subnormals (fewer mantissa bits); ``overflow``: finite values that become inf. Shares are of the
    nonzero fp32 values.
    """
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive finite number (e.g. 2**16), got {scale!r}.")
    info = format_info(fmt)
    g = _flat(grads).double() * scale  # float64: the scaling itself must not round or overflow
    nonzero = g != 0
    cast = g.to(info.dtype).double()  # back to float64 to compare with g
    n_nonzero = int(nonzero.sum())
    underflow = int((nonzero & (cast == 0)).sum())
    overflow = int((torch.isfinite(g) & torch.isinf(cast)).sum())
    subnormal = int((nonzero & (cast != 0) & (cast.abs() < info.smallest_normal)).sum())
    share = (lambda k: k / n_nonzero) if n_nonzero else (lambda k: 0.0)
    return {
        "format": info.name,
        "scale": float(scale),
        "values": g.numel(),
        "nonzero": n_nonzero,
        "underflow": underflow,
        "subnormal": subnormal,
        "overflow": overflow,
        "underflow_share": share(underflow),
        "subnormal_share": share(subnormal),
        "overflow_share": share(overflow),
    }


def log2_abs(grads: torch.Tensor | Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> np.ndarray:
    """``log2 |g|`` of every nonzero gradient value, shape (N_nonzero,)."""
    g = _flat(grads).double()
    g = g[g != 0]
    return torch.log2(g.abs()).numpy()


def format_log2_range(fmt: str | torch.dtype = "fp16") -> dict[str, float]:
    """``log2`` of the smallest subnormal, smallest normal and max of ``fmt``."""
    info = format_info(fmt)
    return {
        "smallest_subnormal": math.log2(info.smallest_subnormal),
        "smallest_normal": math.log2(info.smallest_normal),
        "max": math.log2(info.max),
    }


def grad_log2_hist(
    grads: torch.Tensor | Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
    scale: float = 1.0,
    bins: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of ``log2 |g * scale|`` (nonzero values): ``(counts, bin_edges)``, one bin per power of 2."""
    values = log2_abs(grads) + math.log2(scale)
    if bins is None:
        lo, hi = (math.floor(values.min()), math.ceil(values.max()) + 1) if values.size else (-30, 20)
        bins = np.arange(min(lo, -30), max(hi, 20) + 1)  # at least 2^-30 .. 2^20: one axis for all
    counts, edges = np.histogram(values, bins=bins)
    return counts, edges


def plot_grad_hist(
    grads: torch.Tensor | Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
    scales: Iterable[float] = (1.0, 2.0**16),
    fmt: str | torch.dtype = "fp16",
    ax=None,
    title: str | None = None,
):
    """Histograms of ``log2 |g * scale|`` for each scale, with ``fmt``'s representable range marked."""
    import matplotlib.pyplot as plt

    scales = list(scales)
    values = log2_abs(grads)
    lo = math.floor(min(values.min(), format_log2_range(fmt)["smallest_subnormal"]) - 2)
    hi = math.ceil(max(values.max() + math.log2(max(scales)), format_log2_range(fmt)["max"]) + 2)
    bins = np.arange(lo, hi + 1)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.6))
    for s in scales:
        label = "loss x 1 (unscaled)" if s == 1 else f"loss x 2^{math.log2(s):g}"
        ax.hist(values + math.log2(s), bins=bins, alpha=0.55, label=label)
    r = format_log2_range(fmt)
    name = format_name(fmt)
    ax.axvspan(lo, r["smallest_subnormal"] - 1, color="red", alpha=0.08)  # < half the smallest subnormal: 0
    ax.axvspan(r["smallest_subnormal"] - 1, r["smallest_normal"], color="orange", alpha=0.06)
    ax.axvline(r["smallest_subnormal"] - 1, color="red", ls="--", lw=1, label=f"{name}: below this -> 0")
    ax.axvline(
        r["smallest_normal"],
        color="orange",
        ls="--",
        lw=1,
        label=f"{name} smallest normal (below: subnormal)",
    )
    ax.axvline(r["max"], color="purple", ls="--", lw=1, label=f"{name} max -> above: inf")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("number of gradient values")
    ax.set_yscale("log")
    ax.set_title(title or f"gradients vs. the {name} range")
    ax.legend(fontsize=8, loc="upper left")
    return ax
