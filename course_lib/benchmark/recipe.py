"""Time to accuracy: the recipe ladder behind ``python -m course_lib.cli.recipe`` (README, "Time to accuracy").

The slides' loop (rung 1) fine-tunes the course model for a fixed budget; its final validation
accuracy, less ``tolerance``, is the target. Every further rung adds one change to the stack kept so
far and trains again from the same weights, on the same data, with the same seed and the same
evaluation schedule. A rung *pays* when it reaches the target sooner (wall time, evaluation not
counted) than the stack before it; one that does not is dropped from the stack for the rungs after
it. The recommended recipe is the last kept stack: the fastest measured on this machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from course_lib.benchmark.harness import load_average, machine_summary
from course_lib.benchmark.report import format_cell
from course_lib.benchmark.rungs import (
    RUNG_NAMES,
    Stack,
    apply,
    describe,
    ladder,
    mixed_precision_choice,
    prepare,
    run_stack,
    skip_reason,
    warm_up,
)
from course_lib.devices import get_device
from course_lib.mixed_precision import precision_label
from course_lib.tooling import sections

RECIPE = "recipe"  # the generated section in README.md
RECIPE_RECORD = Path("docs/results/recipe.json")
RECIPE_FILES = ("README.md",)
RENDER_COMMAND = f"python -m course_lib.cli.recipe --from-json {RECIPE_RECORD} --readme README.md"
MEASURE_COMMAND = f"python -m course_lib.cli.recipe --json {RECIPE_RECORD} --readme README.md"
RECIPE_ABOUT = (
    "One run of the recipe ladder (time to a fixed validation accuracy, rung by rung), written by `python -m "
    "course_lib.cli.recipe --json PATH`. The README's recipe section is rendered from docs/results/recipe.json; "
    f"`{RENDER_COMMAND}` renders it again without measuring. See docs/results/README.md."
)
SPEEDUP_TARGET = 1.5  # the recipe vs the slides' loop, time to the target
RAN = ("reference", "kept", "dropped")  # statuses of rows that trained


@dataclass
class RecipeConfig:
    """One ladder run (logged with ``asdict`` in the record)."""

    epochs: int = 1  # the budget of every rung
    batch_size: int = 32
    lr: float = 2e-4  # x sqrt(batch multiple) on the large-batch rung
    weight_decay: float = 0.01
    max_length: int = 128  # rung 1 pads every batch to this
    eval_every: int = 8  # optimizer steps at batch_size between evaluations
    train_rows: int | None = None  # None: the whole train split (rounded down to whole large batches)
    eval_rows: int | None = None  # None: the whole validation split
    tolerance: float = 0.01  # target = rung 1's final accuracy minus this
    target: float | None = None  # a fixed target instead
    large_batch: int = 2  # the large-batch rung's batch multiple
    rungs: tuple[str, ...] = RUNG_NAMES  # the rungs to run; the others get a row saying so
    stop_at_target: bool = False  # end each rung after rung 1 at its first evaluation on target
    memory: bool = True  # peak memory: one more step on the longest batch of each run
    seed: int = 0
    device: str | None = None

    def __post_init__(self) -> None:
        self.rungs = tuple(self.rungs)
        unknown = [r for r in self.rungs if r not in RUNG_NAMES]
        if unknown:
            raise ValueError(
                f"Unknown rung(s) {', '.join(unknown)}: use some of {', '.join(RUNG_NAMES)} (--rungs)."
            )
        if "slides" not in self.rungs:
            raise ValueError("The ladder needs rung 'slides': its run sets the target and the time to beat.")
        for name in ("epochs", "batch_size", "eval_every", "large_batch", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.eval_every % self.large_batch:
            raise ValueError(
                f"eval_every ({self.eval_every}) must be a multiple of large_batch ({self.large_batch}), so that "
                "every rung evaluates after the same training examples."
            )
        if self.lr <= 0 or not 0 <= self.tolerance < 1:
            raise ValueError(
                f"lr must be positive and tolerance in [0, 1), got {self.lr} and {self.tolerance}."
            )


def quick_config(**overrides: Any) -> RecipeConfig:
    """The smoke-test preset: 256 rows, 1 epoch, no compile, no memory step (about a minute on 2 cores)."""
    settings: dict[str, Any] = {
        "batch_size": 16,
        "lr": 1e-3,
        "eval_every": 4,
        "train_rows": 256,
        "eval_rows": 128,
        "rungs": tuple(r for r in RUNG_NAMES if r != "compile"),
        "memory": False,
    }
    return RecipeConfig(**{**settings, **overrides})


def time_to(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation at or above ``target`` (None: not reached)."""
    return next((e for e in evals if e["accuracy"] >= target), None)


def run_ladder(cfg: RecipeConfig, log=print) -> dict[str, Any]:
    """Run the ladder per ``cfg``; return its record (settings, machine, target, a row per rung)."""
    device = get_device(cfg.device)
    start, load = time.perf_counter(), [load_average()]
    prepared = prepare(cfg)
    warm_up(prepared, cfg, device)
    stack, kept_time, target, rows = Stack(), None, cfg.target, []
    for number, rung in enumerate(ladder(cfg.large_batch), start=1):
        row: dict[str, Any] = {"rung": number, "name": rung.name, "label": rung.label}
        rows.append(row)
        if rung.name not in cfg.rungs:
            row.update(status="not run", reason="left out of this run (--rungs / --quick)")
            continue
        reason, precision = skip_reason(rung, stack, prepared.model, device), "no"
        if rung.name == "mixed_precision":
            precision, row["why"] = mixed_precision_choice(device)
            reason = None if precision != "no" else row["why"]
            row["label"] += f" ({precision_label(precision)})" if precision != "no" else ""
        if reason:
            row.update(status="skipped", reason=reason)
            log(f"rung {number} {rung.name}: skipped ({reason})")
            continue
        trial = apply(rung, stack, precision)
        log(f"rung {number} {rung.name}: {describe(trial)} ...")
        stop = target if cfg.stop_at_target and number > 1 else None
        try:
            result = run_stack(trial, prepared, cfg, device, stop_at=stop, memory=cfg.memory)
        except Exception as err:  # a rung that fails (say, a compiler error) is reported, not fatal
            row.update(status="failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            log(f"rung {number} {rung.name}: failed ({row['reason']})")
            continue
        row.update(result, stack=asdict(trial))
        if target is None:  # rung 1 sets it
            target = round(result["final_accuracy"] - cfg.tolerance, 6)
        hit = time_to(result["evals"], target)
        row["steps_to_target"] = hit["step"] if hit else None
        row["examples_to_target"] = hit["examples"] if hit else None
        row["time_to_target_s"] = hit["seconds"] if hit else None
        if number == 1:
            row.update(status="reference", reason="the slides' loop: sets the target and the time to beat")
            stack, kept_time = trial, row["time_to_target_s"]
        elif hit is None:
            row.update(status="dropped", reason="did not reach the target within the budget")
        elif kept_time is None or hit["seconds"] < kept_time:
            row.update(
                status="kept", reason=f"{kept_time / hit['seconds']:.2f}x sooner than the stack before it"
            )
            stack, kept_time = trial, hit["seconds"]
        else:
            seconds = f"{hit['seconds']:.1f} s to the target, not sooner than the {kept_time:.1f} s"
            row.update(status="dropped", reason=f"{seconds} of the stack before it")
        log(f"rung {number} {rung.name}: {row['status']} ({row['reason']})")
    load.append(load_average())
    return {
        "about": RECIPE_ABOUT,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - start,
        "cores": os.cpu_count(),
        "machine": machine_summary(device),
        "load_average": load,
        "config": asdict(cfg),
        "train_rows": len(prepared.train),
        "eval_rows": len(prepared.eval_loader.dataset),
        "target": target,
        "recipe": describe(stack),
        "rows": rows,
    }


def record_config(record: dict[str, Any]) -> RecipeConfig:
    """The ``RecipeConfig`` of a record (settings it lacks take their defaults)."""
    known = {f.name for f in fields(RecipeConfig)}
    return RecipeConfig(**{k: v for k, v in record.get("config", {}).items() if k in known})


def _names(rows: list[dict[str, Any]], statuses: tuple[str, ...], why: bool = False) -> str:
    found = [
        f"{r['rung']} {r['name']}" + (f" ({r['reason']})" if why else "")
        for r in rows
        if r["status"] in statuses
    ]
    return ", ".join(found) or "none"


def verdict(record: dict[str, Any]) -> list[str]:
    """Which rungs paid here, which did not, the recipe and its ratio to rung 1, target met or not."""
    rows = record["rows"]
    ref = rows[0]
    best = [r for r in rows if r["status"] in ("reference", "kept")][-1]  # the last kept stack
    ratio = ref["time_to_target_s"] / best["time_to_target_s"]
    ok = ratio >= SPEEDUP_TARGET
    if ok:
        short = ""
    elif any(r["status"] == "dropped" for r in rows):
        short = f"; short of it because {_names(rows, ('dropped',))} did not pay here"
    else:
        short = f"; the kept rungs ({_names(rows, ('kept',))}) gave too little here"
    return [
        f"Paid here (kept): {_names(rows, ('kept',))}.",
        f"Did not pay (dropped from the stack for the rungs after it): {_names(rows, ('dropped',))}.",
        f"Not run: {_names(rows, ('skipped', 'not run', 'failed'), why=True)}.",
        f"Recommended recipe here: {record['recipe']}. It reached the target in {best['time_to_target_s']:.1f} s "
        f"against {ref['time_to_target_s']:.1f} s for the slides' loop: {ratio:.2f}x sooner "
        f"(target >= {SPEEDUP_TARGET}x: {'met' if ok else 'MISSED'}){short}.",
    ]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return format_cell(value, spec, suffix, missing="-")  # a rung that did not run: "-"


COLUMNS = (
    "rung",
    "change",
    "status",
    "time to target (s)",
    "vs slides",
    "steps to target",
    "tokens/s",
    "real tokens/s",
    "real share",
    "final accuracy",
    "peak mem (MB)",
    "train time (s)",
)


def markdown_table(record: dict[str, Any]) -> str:
    """One line per rung: its change, status, time to target and what it measured."""
    ref = record["rows"][0].get("time_to_target_s")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in record["rows"]:
        t = r.get("time_to_target_s")
        status = r["status"] if r["status"] in ("reference", "kept") else f"{r['status']}: {r['reason']}"
        share = r["real_tokens"] / r["padded_tokens"] if r.get("padded_tokens") else None
        cells = [
            r["rung"],
            r["label"],
            status,
            _fmt(t, ",.1f"),
            _fmt(ref / t if t and ref else None, ".2f", "x"),
            _fmt(r.get("steps_to_target"), "d"),
            _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r.get("real_tokens_per_s"), ",.0f"),
            _fmt(100 * share if share else None, ".0f", "%"),
            _fmt(r.get("final_accuracy"), ".3f"),
            _fmt(r.get("peak_mem_mb"), ",.1f"),
            _fmt(r.get("train_seconds"), ",.1f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def markdown_report(record: dict[str, Any]) -> str:
    """The README section: how it was measured, the table, the verdict."""
    cfg = record_config(record)
    load, machine = record.get("load_average") or [], record["machine"]
    if len(load) == 2 and None not in load:
        machine += f" (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        machine += f", {record['cores']} cores)" if record.get("cores") else ")"
    how = (
        f"the slides' loop's final accuracy after {cfg.epochs} epoch(s), {record['rows'][0]['final_accuracy']:.3f}, "
        f"less a tolerance of {cfg.tolerance:g}"
        if cfg.target is None
        else "fixed for this run"
    )
    header = (
        f"Measured on {machine}, {record['date']}; the whole run took {record['seconds'] / 60:.1f} min. "
        f"Target: validation accuracy >= {record['target']:.3f} ({how}), on {record['eval_rows']:,} validation "
        f"pairs. Every rung: the same {record['train_rows']:,} training pairs, seed {cfg.seed}, {cfg.epochs} "
        f"epoch(s), batch {cfg.batch_size}, lr {cfg.lr:g} with linear decay, an evaluation every "
        f"{cfg.eval_every * cfg.batch_size:,} training examples and at the end. Time: training only (data loading, "
        "forward, backward, optimizer and any compilation); evaluation is not counted; the rungs run one after "
        "another after a few untimed warm-up steps. Tokens/s count every position computed on, real tokens/s only "
        "the unpadded ones. Peak memory: tensor bytes of one more training step on the run's longest batch."
    )
    return (
        f"{header}\n\n{markdown_table(record)}\n\n"
        + "\n".join(f"- {line}" for line in verdict(record))
        + "\n"
    )


def check_committed(root: Path = Path(".")) -> list[str]:
    """Drift of README.md's recipe section against ``docs/results/recipe.json``."""
    report = markdown_report(sections.load_record(root / RECIPE_RECORD, MEASURE_COMMAND))
    problems = [sections.check_block(root / name, RECIPE, report, RENDER_COMMAND) for name in RECIPE_FILES]
    return [p for p in problems if p]


def plot(record: dict[str, Any], path: str | Path | None = None, ax=None):
    """The ladder as bars: seconds to the target per rung, labelled with the ratio to rung 1."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, fig = record["rows"], None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"reference": "#555555", "kept": "#2a9d8f", "dropped": "#e76f51"}
    heights = [r.get("time_to_target_s") or 0.0 for r in rows]
    bars = ax.bar(range(len(rows)), heights, color=[colors.get(r["status"], "#cccccc") for r in rows])
    ref = rows[0].get("time_to_target_s")
    labels = [f"{ref / h:.2f}x" if h and ref else r["status"] for h, r in zip(heights, rows)]
    ax.bar_label(bars, labels, fontsize=7, padding=2)
    ax.set_xticks(
        range(len(rows)), [f"{r['rung']} {r['name']}" for r in rows], rotation=30, ha="right", fontsize=8
    )
    ax.set_ylabel("seconds to the target (training only)")
    ax.set_title(
        f"Time to validation accuracy {record['target']:.3f} (grey: rung 1, green: kept, red: dropped)",
        fontsize=9,
    )
    if fig is not None:
        fig.tight_layout()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
            plt.close(fig)
    return ax


def write_readme_section(path: str | Path, markdown: str) -> None:
    """Put ``markdown`` between ``<!-- recipe:start -->`` and ``<!-- recipe:end -->`` in ``path``."""
    sections.write_block(path, RECIPE, markdown)
