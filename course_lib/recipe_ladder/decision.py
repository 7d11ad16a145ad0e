"""Keep, drop or call within noise: the ladder's rule for one rung against the stack before it.

Time to target = examples to target / examples per second (+ one-off seconds: compilation). The rule:

* **One gain per round**: time to target of the stack before over the rung's, from the same round's
  two throughputs (A B, B A, ...: the load of that round hits both) and the seed medians of examples
  to target. The estimate is the **median over rounds**; its interval (``interval``) leaves the
  largest and the smallest round out: with 5 rounds the 2nd smallest to the 2nd largest, a
  distribution-free interval for the median round (``interval_coverage``: 62.5 % for 5 rounds). One
  round in which the step collapsed on one side of a pair moves neither end past the next round.
* **Examples to target: the median over seeds** (``median_examples``): one seed one evaluation later
  than the others does not decide. A seed that never reached the target counts as later than every
  seed that did, so **one seed that misses cannot decide alone**: the rung is dropped for missing only
  when the median seed missed, or when a seed ended more than one standard error of the validation
  accuracy under the target (``far_misses``: a recipe that can end that far below is not a faster
  recipe, whatever its speed). A seed that ends within one standard error is within the noise of the
  target itself.
* **A threshold stated in advance, symmetric**: kept when the median gain is at least ``min_gain``
  and the interval lies above 1; dropped when the median is at most ``1 / min_gain`` and the interval
  lies below 1; within noise (not kept) otherwise. ``MIN_GAIN`` (5 %) is a requirement, not a
  measurement: every kept rung is another flag and another kernel path to trust, and under 5 % two
  runs of the same recipe on a laptop can differ (clock and thermal state), which pairing within a
  round cannot remove.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

MIN_GAIN = 1.05  # the smallest time-to-target gain worth changing the recipe for
OUTLIERS = 1  # rounds left out at each end of the interval
# the largest share of the examples to target one evaluation step may be (finer: examples_to resolves it)
RESOLUTION = 0.10


def spread(values: list[float]) -> dict[str, float]:
    """Median and range (smallest, largest): what was measured, for the tables."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def interval(values: list[float], outliers: int = OUTLIERS) -> dict[str, float]:
    """Median and the order-statistic interval that leaves ``outliers`` values out at each end.

    Fewer than ``2 * outliers + 1`` values: as many as leave the median (3 values: the median alone).
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


def median_examples(examples: list[int | None]) -> float | None:
    """Median examples to target over seeds; a seed that missed (None) counts after every seed that
    reached it, so the result is None only when the median seed missed."""
    ordered = sorted(examples, key=lambda x: math.inf if x is None else x)
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]  # one value, or two for an even count
    return None if None in middle else statistics.mean(middle)


def decide(
    prev_eps: list[float],
    trial_eps: list[float],
    prev_examples: list[int | None],
    trial_examples: list[int | None],
    prev_once_s: float = 0.0,
    trial_once_s: float = 0.0,
    min_gain: float = MIN_GAIN,
    far_misses: int = 0,
) -> dict[str, Any]:
    """Keep, drop or call within noise (the rule and why: ``course_lib.recipe_ladder.decision``'s docstring).

    ``*_eps``: examples per second, one per interleaved round (paired by round); ``*_examples``:
    examples to target, one per seed (None: missed); ``*_once_s``: one-off seconds (compilation);
    ``far_misses``: the rung's seeds that ended more than one standard error under the target.
    """
    out: dict[str, Any] = {"throughput_ratio": interval([t / p for p, t in zip(prev_eps, trial_eps)])}
    before, after = median_examples(prev_examples), median_examples(trial_examples)
    if far_misses:
        why = (
            f"{far_misses} of {len(trial_examples)} seeds ended more than one standard error under the target"
        )
        return {**out, "status": "dropped", "reason": why}
    if after is None:
        missed = sum(x is None for x in trial_examples)
        why = f"the median seed missed the target within the budget ({missed} of {len(trial_examples)} seeds)"
        return {**out, "status": "dropped", "reason": why}
    out["examples_ratio"] = before / after
    gains = [  # one pair of times to target per round
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
