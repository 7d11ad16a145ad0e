"""The ladder's measurements and decisions (``course_lib.benchmark.recipe`` holds its settings and report).

``run_ladder`` walks the rungs: accuracy runs over seeds for the slides' settings (they set the
target) and for every rung that changes the optimisation; interleaved throughput rounds of each rung
against the stack before it; ``decide`` keeps, drops or calls within noise. ``Measured`` makes the
measurements on this machine; the tests pass a scripted stand-in with the same four methods.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict
from typing import Any

from course_lib.benchmark.harness import load_average, machine_summary
from course_lib.benchmark.rungs import (
    SAME_FUNCTION,
    Stack,
    accuracy_run,
    apply,
    cli_flags,
    describe,
    examples_to,
    ladder,
    mixed_precision_choice,
    prepare,
    skip_reason,
    throughput_run,
    warm_up,
)
from course_lib.devices import get_device
from course_lib.mixed_precision import precision_label


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def decide(
    prev_eps: list[float],
    trial_eps: list[float],
    prev_examples: list[int],
    trial_examples: list[int | None],
    prev_once_s: float = 0.0,
    trial_once_s: float = 0.0,
) -> dict[str, Any]:
    """Keep, drop or call within noise: a rung against the stack before it.

    ``*_eps``: examples per second, one per interleaved round (paired by round); ``*_examples``:
    examples to target, one per seed (paired by seed; None: never reached); ``*_once_s``: one-off
    seconds (compilation). The gain of round r and seed s is the stack before's time to target over
    the rung's; the rung is kept when the smallest gain is above 1, dropped when the largest is below
    1 (or a seed never reached the target), within noise otherwise.
    """
    missed = [i for i, x in enumerate(trial_examples) if x is None]
    out: dict[str, Any] = {"throughput_ratio": spread([t / p for p, t in zip(prev_eps, trial_eps)])}
    if missed:
        return {
            **out,
            "status": "dropped",
            "reason": f"did not reach the target within the budget in {len(missed)} of {len(trial_examples)} seeds",
        }
    out["examples_ratio"] = spread([p / t for p, t in zip(prev_examples, trial_examples)])
    gains = [
        (pe_x / pe + prev_once_s) / (te_x / te + trial_once_s)
        for pe, te in zip(prev_eps, trial_eps)
        for pe_x, te_x in zip(prev_examples, trial_examples)
    ]
    gain = out["gain"] = spread(gains)
    span = f"{gain['median']:.2f}x (range {gain['low']:.2f}-{gain['high']:.2f}x over rounds x seeds)"
    if gain["low"] > 1:
        return {**out, "status": "kept", "reason": f"{span} sooner than the stack before it"}
    if gain["high"] < 1:
        return {**out, "status": "dropped", "reason": f"slower: {span} of the stack before it"}
    return {**out, "status": "within noise", "reason": f"{span}: the range spans 1, so not kept"}


# ---------------------------------------------------------------------------------------------
# Measuring


class Measured:
    """The measurements ``run_ladder`` asks for, made on this machine (tests pass a scripted stand-in)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.device = cfg, get_device(cfg.device)
        self.prepared = prepare(cfg)
        warm_up(self.prepared, cfg, self.device)
        self.train_rows = len(self.prepared.train)
        self.eval_rows = len(self.prepared.eval_loader.dataset)
        self.machine = machine_summary(self.device)

    def skip(self, rung) -> str | None:
        return skip_reason(rung, self.prepared.model, self.device)

    def precision(self) -> tuple[str, str]:
        return mixed_precision_choice(self.device)

    def accuracy(self, stack: Stack, seed: int, stop_at: int | None) -> dict[str, Any]:
        return accuracy_run(stack, self.prepared, self.cfg, seed, self.device, stop_at)

    def throughput(self, stack: Stack, fresh_compile: bool = False) -> dict[str, Any]:
        return throughput_run(stack, self.prepared, self.cfg, self.device, fresh_compile)


def interleaved(measure, a: Stack, b: Stack, rounds: int, log=print) -> tuple[list[dict], list[dict]]:
    """Throughput of ``a`` and ``b`` in ``rounds`` rounds, the order flipped every round (A B, B A, ...).

    ``b``'s first run compiles from an empty cache when ``b`` compiles and ``a`` does not.
    """
    runs: tuple[list[dict], list[dict]] = ([], [])
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            stack = (a, b)[which]
            fresh = which == 1 and r == 0 and b.compile and not a.compile
            runs[which].append(measure.throughput(stack, fresh_compile=fresh))
        log(
            f"  round {r + 1}/{rounds}: {runs[0][-1]['examples_per_s']:,.1f} vs "
            f"{runs[1][-1]['examples_per_s']:,.1f} examples/s"
        )
    return runs


def _throughput_summary(runs: list[dict]) -> dict[str, Any]:
    eps = [r["examples_per_s"] for r in runs]
    return {
        "examples_per_s": eps,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "real_tokens_per_s": statistics.median(r["real_tokens_per_s"] for r in runs),
    }


def run_ladder(cfg, log=print, measure=None) -> dict[str, Any]:
    """Run the ladder per ``cfg`` (a ``RecipeConfig``); return its record (settings, machine, target, rows)."""
    start, load = time.perf_counter(), [load_average()]
    measure = measure or Measured(cfg)
    seeds = [cfg.seed + i for i in range(cfg.seeds)]
    n = measure.eval_rows
    rungs = ladder(cfg.large_batch)

    log(f"rung 1 slides: accuracy runs over seeds {seeds} ...")
    ref_runs = [measure.accuracy(Stack(), s, None) for s in seeds]
    lowest = min(r["final_correct"] for r in ref_runs)
    p = lowest / n
    se = math.sqrt(p * (1 - p) / n)
    tolerance_rows = round(cfg.tolerance_se * se * n)
    target = lowest - tolerance_rows
    ref_examples = [examples_to(r["evals"], target) for r in ref_runs]
    log(f"target: {target} of {n} validation rows correct ({target / n:.3f}); examples to it: {ref_examples}")
    rows: list[dict[str, Any]] = [
        {
            "rung": 1,
            "name": "slides",
            "label": rungs[0].label,
            "status": "reference",
            "reason": "the slides' settings: set the target and the time to beat",
            "same_function": False,
            "stack": asdict(Stack()),
            "accuracy_runs": ref_runs,
            "examples_to_target": ref_examples,
        }
    ]
    stack, examples, once_s, last = Stack(), ref_examples, 0.0, rows[0]
    for number, rung in enumerate(rungs[1:], start=2):
        row: dict[str, Any] = {"rung": number, "name": rung.name, "label": rung.label}
        rows.append(row)
        if rung.name not in cfg.rungs:
            row.update(status="not run", reason="left out of this run (--rungs / --quick)")
            continue
        reason, precision = measure.skip(rung), "no"
        if rung.name == "mixed_precision":
            precision, row["why"] = measure.precision()
            reason = None if precision != "no" else row["why"]
            row["label"] += f" ({precision_label(precision)})" if precision != "no" else ""
        if reason:
            row.update(status="skipped", reason=reason)
            log(f"rung {number} {rung.name}: skipped ({reason})")
            continue
        trial = apply(rung, stack, precision)
        same = row["same_function"] = rung.name in SAME_FUNCTION
        row["stack"] = asdict(trial)
        log(f"rung {number} {rung.name}: {describe(trial)} ...")
        prev_runs, trial_runs = interleaved(measure, stack, trial, cfg.rounds, log)
        trial_once = trial_runs[0].get("compile_s", 0.0) if trial.compile and not stack.compile else once_s
        if same:
            trial_examples = list(examples)
        else:
            row["accuracy_runs"] = [measure.accuracy(trial, s, target) for s in seeds]
            trial_examples = [examples_to(r["evals"], target) for r in row["accuracy_runs"]]
        row.update(_throughput_summary(trial_runs), examples_to_target=trial_examples, once_s=trial_once)
        row["before_examples_per_s"] = [r["examples_per_s"] for r in prev_runs]
        if last is rows[0] and "examples_per_s" not in last:
            last.update(_throughput_summary(prev_runs), once_s=0.0)
        row.update(
            decide(
                row["before_examples_per_s"],
                row["examples_per_s"],
                examples,
                trial_examples,
                once_s,
                trial_once,
            )
        )
        if row["status"] == "kept":
            stack, examples, once_s, last = trial, trial_examples, trial_once, row
        log(f"rung {number} {rung.name}: {row['status']} ({row['reason']})")

    final: dict[str, Any] = {"stack": asdict(stack), "recipe": describe(stack)}
    if stack != Stack():
        log("the recipe against the slides' settings ...")
        ref_tp, recipe_tp = interleaved(measure, Stack(), stack, cfg.rounds, log)
        final.update(
            decide(
                [r["examples_per_s"] for r in ref_tp],
                [r["examples_per_s"] for r in recipe_tp],
                ref_examples,
                examples,
                0.0,
                once_s,
            )
        )
        final["slides_examples_per_s"] = [r["examples_per_s"] for r in ref_tp]
        final["recipe_examples_per_s"] = [r["examples_per_s"] for r in recipe_tp]
    else:
        final.update(gain={"median": 1.0, "low": 1.0, "high": 1.0}, status="reference")
    train_rows = getattr(measure, "train_rows", None)
    final["command"] = "python -m course_lib.cli.train " + " ".join(cli_flags(stack, cfg, train_rows))
    load.append(load_average())
    return {
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - start,
        "cores": os.cpu_count(),
        "machine": getattr(measure, "machine", "scripted"),
        "load_average": load,
        "config": asdict(cfg),
        "train_rows": train_rows,
        "eval_rows": n,
        "seeds": seeds,
        "target": {
            "correct": target,
            "accuracy": target / n,
            "lowest_final_correct": lowest,
            "tolerance_rows": tolerance_rows,
            "standard_error": se,
        },
        "rows": rows,
        "final": final,
    }
