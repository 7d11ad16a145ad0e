"""Reports of a benchmark run: markdown table, target checks, the JSON record, chart, README section."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from course_lib.benchmark.config import (
    BENCH_ABOUT,
    LABELS,
    MODEL_SIZES,
    BenchConfig,
)
from course_lib.benchmark.harness import machine_summary
from course_lib.devices import (
    get_device,
)
from course_lib.instruments.throughput import mfu, model_flops_per_token
from course_lib.mixed_precision import precision_label

COLUMNS = (
    "size",
    "implementation",
    "precision",
    "autocast",
    "step (ms)",
    "tokens/s",
    "vs PyTorch",
    "vs fp32",
    "peak mem (MB)",
    "saved for bwd (MB)",
    "optimizer state (MB)",
    "GFLOP/s",
    "MFU",
    "final loss",
)


def format_cell(value: float | None, spec: str, suffix: str = "", missing: str = "n/a") -> str:
    """``value`` formatted for a table cell; ``missing`` for None or NaN (not measured)."""
    return (
        missing
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:{spec}}{suffix}"
    )


def _shape(row: dict[str, Any]) -> tuple[int, int]:
    """``(n_layers, d_model)`` of a row's model: recorded, or (a record made before they were) its size's."""
    if "n_layers" in row:
        return row["n_layers"], row["d_model"]
    size = MODEL_SIZES[row["model_size"]]
    if size is None:  # the embedded checkpoint's own shape
        from course_lib.models import EMBEDDED_MODEL_DIR

        size = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    return size["n_layers"], size["dim"]


def model_flops(row: dict[str, Any]) -> tuple[float, float]:
    """``(achieved GFLOP/s, MFU)`` of a row, from its tokens/s and matmul peak (one definition of the FLOPs)."""
    per_token = model_flops_per_token(row["n_matmul_params"], *_shape(row), row["seq_len"])
    return per_token * row["tokens_per_s"] / 1e9, mfu(row["tokens_per_s"], per_token, row["peak_gflops"])


def bench_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table, one line per (size, precision, implementation)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        gflops, utilisation = model_flops(r)
        cells = [
            r["model_size"],
            LABELS[r["implementation"]],
            precision_label(r["precision"]),
            "yes" if r["amp_active"] else "no",
            format_cell(r["step_time_s"] * 1e3, ",.1f"),
            format_cell(r["tokens_per_s"], ",.0f"),
            format_cell(r["vs_pytorch"], ".2f", "x"),
            format_cell(r["vs_fp32"], ".2f", "x"),
            format_cell(r["peak_mem_mb"], ",.0f"),
            format_cell(r.get("saved_for_backward_mb"), ",.1f"),
            format_cell(r.get("optimizer_state_mb"), ",.1f"),
            format_cell(gflops, ",.1f"),
            format_cell(100 * utilisation, ".1f", "%"),
            format_cell(r["final_loss"], ".4f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def target_checks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The course's targets (issue 6), one line each: the measured ratio, the noise, met or not.

    * the course loop >= 0.98x the PyTorch loop's tokens/s, and faster than Trainer (every row);
    * bf16 >= 1.8x fp32 with the course loop at base size (on a CPU with fast bf16 matmuls);
    * mixed precision's peak memory below fp32's at base size.

    Timing lines carry the round-to-round spread of the two rows compared: a ratio closer to its
    target than that is noise, whatever the verdict says.
    """
    index = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    lines = []
    for (size, precision, impl), r in index.items():
        if impl != "course":
            continue
        label = f"{size} {precision_label(precision)}"
        base = index.get((size, precision, "pytorch"))
        if base:
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            lines.append(
                f"course loop vs PyTorch loop, {label}: {ratio:.3f}x{_noise(r, base)} "
                f"(target >= 0.98x: {_ok(ratio >= 0.98)})"
            )
        trainer = index.get((size, precision, "trainer"))
        if trainer:
            ratio = r["tokens_per_s"] / trainer["tokens_per_s"]
            fp32 = (
                " (Trainer ran in fp32: no autocast)"
                if trainer.get("amp_active") is False and precision != "no"
                else ""
            )
            lines.append(
                f"course loop vs Trainer, {label}: {ratio:.3f}x{_noise(r, trainer)} "
                f"(target > 1x: {_ok(ratio > 1)}){fp32}"
            )
        fp32_row = index.get((size, "no", impl))
        if precision == "bf16" and fp32_row:
            ratio = r["tokens_per_s"] / fp32_row["tokens_per_s"]
            target = f" (target >= 1.8x on a fast-bf16 CPU: {_ok(ratio >= 1.8)})" if size == "base" else ""
            lines.append(f"course loop bf16 over fp32, {size}: {ratio:.2f}x{_noise(r, fp32_row)}{target}")
    for (size, precision, impl), r in index.items():
        fp32_row = index.get((size, "no", impl))
        if size != "base" or precision == "no" or not fp32_row:
            continue
        if r.get("peak_mem_mb") is None or fp32_row.get("peak_mem_mb") is None:
            continue
        ok = r["peak_mem_mb"] < fp32_row["peak_mem_mb"]
        lines.append(
            f"peak memory {precision_label(precision)} vs fp32, {size}, {LABELS[impl]}: "
            f"{r['peak_mem_mb']:,.0f} vs {fp32_row['peak_mem_mb']:,.0f} MB (target: below: {_ok(ok)})"
        )
    return lines


def _noise(*rows: dict[str, Any]) -> str:
    """`` (spread ±x%)``: the larger round-to-round spread of the rows' step times; empty if unknown."""
    spreads = []
    for r in rows:
        times = r.get("step_time_rounds_s") or []
        if len(times) >= 2:
            spreads.append((max(times) - min(times)) / statistics.median(times))
    return f" (rounds spread {100 * max(spreads):.0f}%)" if spreads else ""


def _ok(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown_report(
    rows: Sequence[dict[str, Any]], cfg: BenchConfig, seconds: float | None = None, cores: int | None = None
) -> str:
    """Table plus the settings and machine it was measured with (what the README section holds).

    ``cores``: the measuring machine's core count (default: this machine's; 0 leaves it out).
    """
    cores = os.cpu_count() if cores is None else cores
    machine = rows[0]["machine"] if rows else machine_summary(get_device(cfg.device))
    took = f"; the whole run took {seconds / 60:.1f} min" if seconds is not None else ""
    methods = {r["peak_mem_method"] for r in rows} - {None}
    memory = {
        "cuda_allocator": "the CUDA allocator's peak",
        "rss_subprocess": "the peak RSS of a fresh process",
        "tensor_peak": f"the peak of tensor bytes allocated during {cfg.memory_steps} training "
        f"step{'s' * (cfg.memory_steps != 1)}: the "
        "CUDA allocator's counter on a GPU, torch.profiler's allocation records on a CPU",
    }
    mem_note = (
        "Peak memory: what training added on top of the model's fp32 weights ("
        + ", ".join(memory[m] for m in sorted(methods))
        + "). "
        if methods
        else "Peak memory not measured. "
    )
    load = rows[0].get("load_average") if rows else None
    if load and None not in load:
        machine += f" (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        machine += f", {cores} cores)" if cores else ")"
    header = (
        f"Measured on {machine}. Batches of {cfg.batch_size} x {cfg.seq_len} tokens (padded), "
        f"{cfg.rounds} interleaved rounds x {cfg.steps} timed steps after {cfg.warmup} warm-up step(s), "
        f"median step time{took}. {mem_note}MFU: 6N + 12 x layers x d_model x seq_len FLOPs per token (PaLM) over the measured matmul peak of "
        "the dtype the row computed in."
    )
    return f"{header}\n\n{bench_table(rows)}\n"


def make_record(
    rows: Sequence[dict[str, Any]], cfg: BenchConfig, seconds: float | None = None
) -> dict[str, Any]:
    """The record of one run: everything ``markdown_report`` needs, so the report renders without measuring.

    ``{"about", "date", "seconds" (the whole run), "cores", "config" (``asdict(cfg)``), "rows"}``.
    """
    return {
        "about": BENCH_ABOUT,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": seconds,
        "cores": os.cpu_count(),
        "config": asdict(cfg),
        "rows": [dict(row) for row in rows],
    }


def save_record(path: str | Path, record: dict[str, Any]) -> None:
    """Write a run's record as indented JSON (UTF-8, non-ASCII kept readable), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def record_config(record: dict[str, Any]) -> BenchConfig:
    """The ``BenchConfig`` of a record; settings a record lacks take their defaults (unused by the report)."""
    known = {f.name for f in fields(BenchConfig)}
    return BenchConfig(**{k: v for k, v in record.get("config", {}).items() if k in known})


def report_from_record(record: dict[str, Any]) -> str:
    """``markdown_report`` of a record, rendered without measuring (the core count is the record's)."""
    # or 0: a record without "cores" says nothing, rather than this (rendering) machine's count
    return markdown_report(
        record["rows"], record_config(record), record.get("seconds"), cores=record.get("cores") or 0
    )


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Bar chart of tokens/s: a panel per model size, implementations grouped, a bar per precision.

    Each bar is labelled with its ratio to the plain PyTorch loop in the same precision.
    """
    import matplotlib

    matplotlib.use("Agg")  # a file, not a window: no display needed (before pyplot is imported)
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["model_size"] for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    index = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(6.0, 4.5 * len(sizes)), 4.2), squeeze=False)
    width = 0.8 / len(precisions)
    for ax, size in zip(axes[0], sizes):
        top = 0.0
        for j, precision in enumerate(precisions):
            xs, ys, labels = [], [], []
            for i, impl in enumerate(impls):
                r = index.get((size, precision, impl))
                if r:
                    xs.append(i + (j - (len(precisions) - 1) / 2) * width)  # the precisions centred on i
                    ys.append(r["tokens_per_s"])
                    labels.append(format_cell(r.get("vs_pytorch"), ".2f", "x"))
            bars = ax.bar(xs, ys, width, label=precision_label(precision))
            ax.bar_label(bars, labels, fontsize=7, padding=2)
            top = max([top, *ys])
        ax.set_ylim(0, top * 1.3)  # room above the tallest bar for its label and the legend
        ax.set_xticks(range(len(impls)), [LABELS[i] for i in impls], rotation=20, ha="right")
        ax.set_title(f"{size} model", fontsize=10)
        ax.set_ylabel("tokens / s")
        ax.legend(title="precision", fontsize=8, title_fontsize=8, loc="upper right", ncols=len(precisions))
    machine = rows[0]["machine"] if rows else ""
    fig.suptitle(
        f"Training throughput, same model, data and shapes (labels: vs the PyTorch loop)\n{machine}",
        fontsize=8,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
