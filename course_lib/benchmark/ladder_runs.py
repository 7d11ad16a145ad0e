"""The ladder's measurements and decisions (``course_lib.benchmark.recipe`` holds its settings and report).

``run_ladder`` walks the rungs: accuracy runs over seeds for the slides' settings (they set the
target) and for every rung that changes the optimisation; interleaved throughput rounds of each rung
against the stack before it; ``decide`` keeps, drops or calls within noise (its docstring gives the
rule and why). ``Measured`` makes the measurements on this machine; the tests pass a scripted
stand-in with the same four methods.
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

MIN_GAIN = 1.05  # the smallest time-to-target gain worth changing the recipe for (see ``decide``)
OUTLIERS = 1  # rounds left out at each end of the interval (see ``interval``)


def spread(values: list[float]) -> dict[str, float]:
    """Median and range (smallest, largest): what was measured, for the tables."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def interval(values: list[float], outliers: int = OUTLIERS) -> dict[str, float]:
    """Median and the order-statistic interval that leaves ``outliers`` values out at each end.

    With 5 values and one left out at each end: the 2nd smallest to the 2nd largest, so one round in
    which the step collapsed (on either side of a pair) moves neither end past the next round. Fewer
    than ``2 * outliers + 1`` values: as many as leave the median (3 values: the median alone).
    """
    ordered = sorted(values)
    k = min(outliers, (len(ordered) - 1) // 2)  # the median always stays (3 values: the median alone)
    return {"median": statistics.median(ordered), "low": ordered[k], "high": ordered[len(ordered) - 1 - k]}


def interval_coverage(n: int, outliers: int = OUTLIERS) -> float:
    """Probability that ``interval`` of ``n`` independent values contains their distribution's median.

    The interval from the (k+1)-th smallest to the (k+1)-th largest misses the median only when at
    most k values fall on one side: 1 - 2 P(Binomial(n, 1/2) <= k), whatever the distribution.
    """
    k = min(outliers, (n - 1) // 2)
    return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def seconds_to_target(examples: float, examples_per_s: float, once_s: float = 0.0) -> float:
    """Time to target: the examples it takes at the rate they are trained, plus one-off seconds (compiling)."""
    return examples / examples_per_s + once_s


def decide(
    prev_eps: list[float],
    trial_eps: list[float],
    prev_examples: list[int],
    trial_examples: list[int | None],
    prev_once_s: float = 0.0,
    trial_once_s: float = 0.0,
    min_gain: float = MIN_GAIN,
) -> dict[str, Any]:
    """Keep, drop or call within noise: a rung against the stack before it.

    ``*_eps``: examples per second, one per interleaved round (paired by round); ``*_examples``:
    examples to target, one per seed (None: never reached); ``*_once_s``: one-off seconds
    (compilation); ``min_gain``: the smallest gain worth changing the recipe for.

    The rule and why:

    * **A seed that never reaches the target drops the rung.** A recipe that sometimes does not get
      there within the budget is not a faster recipe, whatever its speed.
    * **Examples to target: the median over seeds**, one number per stack. It is read off the
      evaluation schedule, so it moves in whole evaluation intervals: with 3 seeds, one seed one
      interval later than the others spans the whole range, and a rule that took every seed's value
      would let that one seed decide. The median of 3 ignores one such seed; the seeds' range is
      reported beside it, not used.
    * **One gain per round**: time to target of the stack before over the rung's, each from the
      same round's two throughputs (A B, B A, ...: the load of that round hits both) and the two
      seed medians, plus one-off seconds. The estimate is the **median over rounds**; its interval
      (``interval``) leaves the largest and the smallest round out: with 5 rounds the 2nd smallest to
      the 2nd largest, a distribution-free interval for the median round (``interval_coverage``:
      62.5 % for 5 rounds, 87.5 % for 7). One round in which the step collapsed on one side of a
      pair (a competitor took the cores) moves the median and the interval by at most one round's
      place, never past the next round; the range (smallest to largest) it replaces was decided by
      the single worst round.
    * **A threshold stated in advance, symmetric**: the rung is **kept** when the median gain is at
      least ``min_gain`` and the interval lies above 1 (it needs 4 of 5 rounds faster: were the rung
      no faster, with independent rounds that happens with probability 6/32, and the median round
      must be ``min_gain`` faster as well); **dropped** when the median is at most ``1 / min_gain``
      and the interval lies below 1; **within noise** (not kept) otherwise. ``min_gain`` (5 %) is a
      requirement, not a measurement: a change of the recipe is another flag, another kernel path
      that a learner's machine may lack, another numerical path to trust, and a gain under 5 % of a
      training run is within what can separate two runs of the same recipe on a laptop (its clock
      and thermal state can change that much between runs, which pairing within a round cannot
      remove). A rung whose true gain is near ``min_gain`` still moves between kept and within noise
      from run to run; the threshold puts that boundary at a gain stated in advance, not at whatever
      the worst round measured.
    """
    missed = [i for i, x in enumerate(trial_examples) if x is None]
    out: dict[str, Any] = {"throughput_ratio": interval([t / p for p, t in zip(prev_eps, trial_eps)])}
    if missed:
        return {
            **out,
            "status": "dropped",
            "reason": f"did not reach the target within the budget in {len(missed)} of {len(trial_examples)} seeds",
        }
    before, after = statistics.median(prev_examples), statistics.median(trial_examples)
    out["examples_ratio"] = before / after
    # one pair of times to target per round
    gains = [
        seconds_to_target(before, pe, prev_once_s) / seconds_to_target(after, te, trial_once_s)
        for pe, te in zip(prev_eps, trial_eps)
    ]
    gain = out["gain"] = interval(gains)
    span = f"{gain['median']:.2f}x (interval {gain['low']:.2f}-{gain['high']:.2f}x over {len(gains)} rounds)"
    if gain["median"] >= min_gain and gain["low"] > 1:
        return {**out, "status": "kept", "reason": f"{span} sooner than the stack before it"}
    if gain["median"] <= 1 / min_gain and gain["high"] < 1:
        return {**out, "status": "dropped", "reason": f"slower: {span} of the stack before it"}
    if gain["low"] > 1 or gain["high"] < 1:
        why = f"{'faster' if gain['low'] > 1 else 'slower'} by less than the {min_gain - 1:.0%} that would decide it"
    else:
        why = "the interval spans 1"
    return {**out, "status": "within noise", "reason": f"{span}: {why}, so not kept"}


# ---------------------------------------------------------------------------------------------
# Measuring


class Measured:
    """The measurements ``run_ladder`` asks for, made on this machine (tests pass a scripted stand-in)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.device = cfg, get_device(cfg.device)
        self.prepared = prepare(cfg)
        warm_up(self.prepared, cfg, self.device)
        self.train_rows = len(self.prepared.train)
        self.timed_rows = len(self.prepared.timed)  # the rows every throughput run times (rungs.timed_rows)
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
    se = math.sqrt(p * (1 - p) / n)  # the binomial standard error of an accuracy on n rows
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
        # a stack that compiles already carries its compile seconds into every later rung
        trial_once = trial_runs[0].get("compile_s", 0.0) if trial.compile and not stack.compile else once_s
        if same:
            trial_examples = list(examples)
        else:
            row["accuracy_runs"] = [measure.accuracy(trial, s, target) for s in seeds]
            trial_examples = [examples_to(r["evals"], target) for r in row["accuracy_runs"]]
        row.update(_throughput_summary(trial_runs), examples_to_target=trial_examples, once_s=trial_once)
        row["before_examples_per_s"] = [r["examples_per_s"] for r in prev_runs]
        if last is rows[0] and "examples_per_s" not in last:  # rung 1's throughput: its first comparison
            last.update(_throughput_summary(prev_runs), once_s=0.0)
        row.update(
            decide(
                row["before_examples_per_s"],
                row["examples_per_s"],
                examples,
                trial_examples,
                once_s,
                trial_once,
                cfg.min_gain,
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
                cfg.min_gain,
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
        "timed_rows": getattr(measure, "timed_rows", None),
        "eval_rows": n,
        "seeds": seeds,
        "target": {
            "correct": target,
            "accuracy": target / n,
            "lowest_final_correct": lowest,
            "tolerance_rows": tolerance_rows,
            "standard_error": se,
        },
        "rule": {
            "min_gain": cfg.min_gain,
            "outliers": OUTLIERS,
            "rounds": cfg.rounds,
            "interval_coverage": interval_coverage(cfg.rounds),
            "examples": "median over seeds",
        },
        "rows": rows,
        "final": final,
    }
