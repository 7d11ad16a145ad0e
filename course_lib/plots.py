"""Small matplotlib helpers for the lessons: loss curves, evaluation curves, bar charts.

Every function draws on ``ax`` (a new figure when ``ax`` is None) and returns the ``Axes`` (or the
``Figure`` when it draws several panels). Nothing here calls ``plt.show()``: a notebook shows the
figure itself. Importing this module lets matplotlib draw Japanese labels (``use_japanese_font``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from course_lib.training import History

Series = History | Sequence[float]

# Fonts with Japanese glyphs, the first found is used: Debian's fonts-noto-cjk (what CI installs), then
# what macOS and Windows ship.
JAPANESE_FONTS = (
    "Noto Sans CJK JP",
    "Noto Sans JP",
    "IPAexGothic",
    "Hiragino Sans",
    "Yu Gothic",
    "MS Gothic",
)


def use_japanese_font() -> str | None:
    """Put the first installed font of ``JAPANESE_FONTS`` first in matplotlib's sans-serif list; return
    its name, or None when none is installed (Japanese labels then draw as boxes, with a warning).

    A font installed after matplotlib built its font cache is found by scanning the system's fonts.
    """
    known = {f.name for f in font_manager.fontManager.ttflist}
    if not known.intersection(JAPANESE_FONTS):
        for path in font_manager.findSystemFonts():
            if "cjk" in path.lower() or "ipaex" in path.lower():
                font_manager.fontManager.addfont(path)
        known = {f.name for f in font_manager.fontManager.ttflist}
    name = next((n for n in JAPANESE_FONTS if n in known), None)
    if name is not None and plt.rcParams["font.sans-serif"][:1] != [name]:
        plt.rcParams["font.sans-serif"] = [name, *plt.rcParams["font.sans-serif"]]
        plt.rcParams["font.family"] = "sans-serif"
    return name


JAPANESE_FONT = use_japanese_font()


def _new_ax(ax: Axes | None, figsize: tuple[float, float] = (6.0, 3.5)) -> Axes:
    """``ax``, or the axes of a new figure of ``figsize``."""
    if ax is not None:
        return ax
    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _losses(series: Series) -> list[float]:
    """Per-step losses of a ``History`` or a plain sequence of floats."""
    values = series.losses if isinstance(series, History) else series
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"Expected a History or a sequence of numbers, got {type(series).__name__}: pass "
            "history (from training.train) or history.losses."
        ) from err


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (same length as ``values``)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}.")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))  # the first window - 1 points: the mean of those so far
    return out


def plot_losses(
    histories: Mapping[str, Series],
    smooth: int = 1,
    ax: Axes | None = None,
    title: str = "Training loss",
    xlabel: str = "optimizer step",
) -> Axes:
    """One training-loss curve per run; ``smooth`` > 1 adds a trailing moving average over the raw curve."""
    if not histories:
        raise ValueError("No runs to plot: pass e.g. {'pretrained': history_a, 'scratch': history_b}.")
    ax = _new_ax(ax)
    for name, series in histories.items():
        losses = _losses(series)
        steps = range(1, len(losses) + 1)
        if smooth > 1:
            (line,) = ax.plot(steps, losses, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(losses, smooth), color=line.get_color(), label=name)
        else:
            ax.plot(steps, losses, label=name)
    ax.set(xlabel=xlabel, ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_evals(
    histories: Mapping[str, History],
    metric: str = "accuracy",
    baseline: float | None = None,
    baseline_label: str = "majority class",
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Validation ``metric`` after each epoch, per run, against an optional horizontal baseline."""
    ax = _new_ax(ax)
    for name, history in histories.items():
        if not history.evals:
            raise ValueError(f"Run {name!r} has no evaluations: train with an eval_dataloader.")
        if metric not in history.evals[0]:
            raise KeyError(f"Metric {metric!r} not recorded; available: {sorted(history.evals[0])}.")
        ax.plot(
            [e["step"] for e in history.evals], [e[metric] for e in history.evals], marker="o", label=name
        )
    if baseline is not None:
        ax.axhline(
            baseline, color="gray", linestyle="--", linewidth=1, label=f"{baseline_label} ({baseline:.3f})"
        )
    if metric in ("accuracy", "f1"):  # scores in [0, 1]: do not zoom until 0.01 looks like a leap
        values = [e[metric] for h in histories.values() for e in h.evals]
        ax.set_ylim(*score_limits(values + ([baseline] if baseline is not None else [])))
    ax.set_xlim(left=0)  # aligned with the loss curves' step axis
    ax.set(xlabel="optimizer step", ylabel=f"validation {metric}", title=title or f"Validation {metric}")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def score_limits(values: Sequence[float], min_span: float = 0.2) -> tuple[float, float]:
    """Y limits inside [0, 1] that hold ``values`` and span at least ``min_span``."""
    lo, hi = min(values) - 0.02, max(values) + 0.02
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    if lo < 0:  # shifted inside [0, 1], the span kept
        lo, hi = 0.0, hi - lo
    if hi > 1:
        lo, hi = max(0.0, lo - (hi - 1)), 1.0
    return lo, hi


def plot_comparison(
    histories: Mapping[str, History],
    baseline: float | None = None,
    smooth: int = 10,
    metric: str = "accuracy",
) -> Figure:
    """Two panels side by side: training loss curves and validation ``metric`` per epoch."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 3.8), layout="constrained")
    plot_losses(histories, smooth=smooth, ax=left)
    plot_evals(histories, metric=metric, baseline=baseline, ax=right)
    return fig


def bar_chart(
    values: Mapping[str, float] | Mapping[str, Mapping[str, float]] | Sequence[tuple[str, float]],
    ylabel: str,
    title: str = "",
    log: bool | str = False,
    fmt: str = "{:.3g}",
    ax: Axes | None = None,
) -> Axes:
    """Bars labelled with their values; a mapping of mappings draws grouped bars (group -> series -> value).

    Use ``log=True`` when values span orders of magnitude (fp16 vs bf16 matmul on some CPUs), or
    ``log="auto"``: a log scale only when the largest value is over 30x the smallest.
    NaN values (not measured) leave a gap labelled "n/a".
    """
    groups = _as_groups(values)
    series = list(dict.fromkeys(name for row in groups.values() for name in row))
    measured = [v for row in groups.values() for v in row.values() if not math.isnan(v)]
    if log == "auto":
        log = bool(measured) and min(measured) > 0 and max(measured) > 30 * min(measured)
    elif not isinstance(log, bool):
        raise ValueError(f"log must be True, False or 'auto', got {log!r}.")
    if log and any(v <= 0 for v in measured):
        raise ValueError("A log-scale bar chart needs positive values: use log=False.")
    ax = _new_ax(ax)
    width = 0.8 / len(series)
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [row.get(name, math.nan) for row in groups.values()]
        # a NaN as a zero-height bar: its slot stays, labelled "n/a"
        bars = ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=name if name else None)
        ax.bar_label(bars, labels=["n/a" if math.isnan(y) else fmt.format(y) for y in ys], fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 100, not 10^2
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1 or series[0]:  # a flat mapping's one series is named "": no legend
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    ax.margins(y=0.15)
    return ax


def _as_groups(values: Any) -> dict[str, dict[str, float]]:
    """Normalise the inputs of ``bar_chart`` to {group: {series: value}} ('' is the only series if flat)."""
    items = list(values.items()) if isinstance(values, Mapping) else list(values)
    if not items:
        raise ValueError("Nothing to plot: pass e.g. {'fp32': 170.0, 'bf16': 410.0}.")
    groups: dict[str, dict[str, float]] = {}
    for item in items:
        try:
            label, value = item
        except (TypeError, ValueError) as err:
            raise TypeError(f"Expected (label, value) pairs or a mapping, got {item!r}.") from err
        if isinstance(value, Mapping):
            groups[str(label)] = {str(k): float(v) for k, v in value.items()}
        else:
            groups[str(label)] = {"": float(value)}
    return groups
