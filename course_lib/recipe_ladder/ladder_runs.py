"""The ladder's walk: rung by rung, its measurements in order, its decisions, its record (``run_ladder``).

Accuracy runs over seeds for the slides' settings (they set the target) and for every rung that
changes the optimisation; interleaved throughput rounds of each rung against the stack before it;
``decision.decide`` keeps, drops or calls within noise. ``Measured`` makes the measurements on this
machine; the tests pass a scripted stand-in with the same four methods. Each rung's line says the
machine's 1-minute load average when it started, and the record keeps it with the OpenMP wait policy.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict
from typing import Any

from course_lib.benchmark.harness import load_average, machine_summary
from course_lib.devices import get_device
from course_lib.mixed_precision import precision_label
from course_lib.recipe_ladder.decision import OUTLIERS, RESOLUTION, decide, interval_coverage
from course_lib.recipe_ladder.recipe import RECIPE_ABOUT
from course_lib.recipe_ladder.rungs import (
    SAME_FUNCTION,
    Stack,
    apply,
    cli_flags,
    describe_stack,
    ladder,
    mixed_precision_choice,
    settings_change,
    skip_reason,
)
from course_lib.recipe_ladder.runs import accuracy_run, examples_to, prepare, throughput_run, warm_up


class Measured:
    """The measurements ``run_ladder`` asks for, made on this machine (tests pass a scripted stand-in).

    ``precision``: a ``rungs.mixed_precision_choice`` already measured on this device (lesson 07 shows
    it before the ladder), so that one run decides the mixed-precision rung by one matmul measurement.
    """

    def __init__(self, cfg, precision: tuple[str, str] | None = None) -> None:
        self.cfg, self.device, self.chosen = cfg, get_device(cfg.device), precision
        self.prepared = prepare(cfg)
        warm_up(self.prepared, cfg, self.device)
        self.train_rows = len(self.prepared.train)
        self.timed_rows = len(self.prepared.timed)  # the rows every throughput run times (runs.timed_rows)
        self.eval_rows = len(self.prepared.eval_loader.dataset)
        self.machine = machine_summary(self.device)

    def skip(self, rung) -> str | None:
        return skip_reason(rung, self.prepared.model, self.device)

    def precision(self) -> tuple[str, str]:
        return self.chosen if self.chosen is not None else mixed_precision_choice(self.device)

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
            # compilation is paid once, so it is timed once: b's first run, from an empty cache
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


def _wait_policy() -> str:
    return os.environ.get("OMP_WAIT_POLICY") or "unset (OpenMP's default: waiting threads spin)"


def _far_misses(runs: list[dict[str, Any]], target: int, se_rows: float) -> int:
    """Seeds that missed and whose best evaluation stayed more than one standard error under the target."""
    return sum(
        examples_to(r["evals"], target) is None and target - max(e["correct"] for e in r["evals"]) > se_rows
        for r in runs
    )


def _target(ref_runs: list[dict[str, Any]], n: int, cfg) -> dict[str, Any]:
    """Rung 1's lowest final correct rows less ``cfg.tolerance_se`` binomial standard errors, in rows."""
    lowest = min(r["final_correct"] for r in ref_runs)
    p = lowest / n
    se = math.sqrt(p * (1 - p) / n)  # the binomial standard error of an accuracy on n rows
    tolerance_rows = round(cfg.tolerance_se * se * n)
    correct = lowest - tolerance_rows
    examples = [examples_to(r["evals"], correct) for r in ref_runs]
    step = cfg.eval_every * cfg.batch_size  # training examples between two evaluations
    return {
        "correct": correct,
        "accuracy": correct / n,
        "lowest_final_correct": lowest,
        "tolerance_rows": tolerance_rows,
        "standard_error": se,
        "eval_step": step,
        # one evaluation step as a share of the examples to target: at most RESOLUTION resolves it
        "eval_step_share": step / statistics.median(examples),
    }


def run_ladder(cfg, log=print, measure=None) -> dict[str, Any]:
    """Run the ladder per ``cfg`` (a ``RecipeConfig``); return its record (settings, machine, target, rows)."""
    start, load = time.perf_counter(), [load_average()]
    log(f"1-minute load average {load[0]} on {os.cpu_count()} cores; OMP_WAIT_POLICY={_wait_policy()}")
    measure = measure or Measured(cfg)
    seeds = [cfg.seed + i for i in range(cfg.seeds)]
    n = measure.eval_rows
    rungs = ladder(cfg.large_batch)

    log(f"rung 1 slides: accuracy runs over seeds {seeds} ...")
    ref_runs = [measure.accuracy(Stack(), s, None) for s in seeds]
    target = _target(ref_runs, n, cfg)
    se_rows = target["standard_error"] * n
    ref_examples = [examples_to(r["evals"], target["correct"]) for r in ref_runs]
    log(
        f"target: {target['correct']} of {n} validation rows correct ({target['accuracy']:.3f}); examples to it: "
        f"{ref_examples}; one evaluation every {target['eval_step']} examples = {target['eval_step_share']:.0%} "
        f"of their median"
        + (
            ""
            if target["eval_step_share"] <= RESOLUTION
            else f" (over {RESOLUTION:.0%}: use a smaller eval_every)"
        )
    )
    rows: list[dict[str, Any]] = [
        {
            "rung": 1,
            "name": "slides",
            "label": rungs[0].label,
            "sets": settings_change(None, Stack(), cfg),
            "status": "reference",
            "reason": "the slides' settings: set the target and the time to beat",
            "same_function": False,
            "stack": asdict(Stack()),
            "load_average": load[0],
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
        row.update(stack=asdict(trial), sets=settings_change(stack, trial, cfg), load_average=load_average())
        log(f"rung {number} {rung.name} (load average {row['load_average']}): {row['sets']} ...")
        prev_runs, trial_runs = interleaved(measure, stack, trial, cfg.rounds, log)
        # a stack that compiles already carries its compile seconds into every later rung
        trial_once = trial_runs[0].get("compile_s", 0.0) if trial.compile and not stack.compile else once_s
        far = 0
        if same:
            trial_examples = list(examples)
        else:
            row["accuracy_runs"] = [measure.accuracy(trial, s, target["correct"]) for s in seeds]
            trial_examples = [examples_to(r["evals"], target["correct"]) for r in row["accuracy_runs"]]
            far = row["far_misses"] = _far_misses(row["accuracy_runs"], target["correct"], se_rows)
        row.update(_throughput_summary(trial_runs), examples_to_target=trial_examples, once_s=trial_once)
        row["before_examples_per_s"] = [r["examples_per_s"] for r in prev_runs]
        if last is rows[0] and "examples_per_s" not in last:  # rung 1's throughput: its first comparison
            last.update(_throughput_summary(prev_runs), once_s=0.0)
        before_eps, trial_eps = row["before_examples_per_s"], row["examples_per_s"]
        row.update(
            decide(before_eps, trial_eps, examples, trial_examples, once_s, trial_once, cfg.min_gain, far)
        )
        if row["status"] == "kept":
            stack, examples, once_s, last = trial, trial_examples, trial_once, row
        log(f"rung {number} {rung.name}: {row['status']} ({row['reason']})")

    final: dict[str, Any] = {"stack": asdict(stack), "recipe": describe_stack(stack)}
    if stack != Stack():
        log(f"the recipe against the slides' settings (load average {load_average()}) ...")
        ref_tp, recipe_tp = interleaved(measure, Stack(), stack, cfg.rounds, log)
        final["slides_examples_per_s"] = [r["examples_per_s"] for r in ref_tp]
        final["recipe_examples_per_s"] = [r["examples_per_s"] for r in recipe_tp]
        eps = (final["slides_examples_per_s"], final["recipe_examples_per_s"])
        final.update(decide(*eps, ref_examples, examples, 0.0, once_s, cfg.min_gain))
    else:
        final.update(gain={"median": 1.0, "low": 1.0, "high": 1.0}, status="reference")
    train_rows = getattr(measure, "train_rows", None)
    final["command"] = "python -m course_lib.cli.train " + " ".join(cli_flags(stack, cfg, train_rows))
    load.append(load_average())
    log(f"1-minute load average at the end: {load[1]}")
    return {
        "about": RECIPE_ABOUT,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - start,
        "cores": os.cpu_count(),
        "machine": getattr(measure, "machine", "scripted"),
        "load_average": load,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "config": asdict(cfg),
        "train_rows": train_rows,
        "timed_rows": getattr(measure, "timed_rows", None),
        "eval_rows": n,
        "seeds": seeds,
        "target": target,
        "rule": {
            "min_gain": cfg.min_gain,
            "outliers": OUTLIERS,
            "rounds": cfg.rounds,
            "interval_coverage": interval_coverage(cfg.rounds),
            "examples": "median over seeds",
            "misses": "a missed seed counts after the others; one more than 1 standard error under drops the rung",
            "resolution": RESOLUTION,
        },
        "rows": rows,
        "final": final,
    }
