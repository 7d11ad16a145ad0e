"""Time to accuracy: the recipe ladder behind ``python -m course_lib.cli.recipe`` (README, "Time to accuracy").

Time to target = examples to target / examples per second (+ compilation, where a stack compiles),
each factor measured the way it is stable:

* **Examples per second**: each rung is timed against the stack before it in ``rounds`` short,
  interleaved rounds (A B, B A, A B, ...), so load on the machine hits both alike; the rung's gain
  is taken per round (paired).
* **Examples to target**: from the evaluation schedule, over ``seeds`` seeds (median and range), for
  the rungs that change the optimisation (length grouping, mixed precision, a larger batch). The
  rungs that change only the kernels or the padding (``rungs.SAME_FUNCTION``) compute the same
  function, so their examples to target are those of the stack before them.

Target: the lowest final validation accuracy of the slides' settings over the seeds, less
``tolerance_se`` binomial standard errors of the validation set (counted in validation rows). The
decision, keep / drop / within noise, and its reasons: ``decision.decide``. The recommended recipe
is the last kept stack; it is measured once more against the slides' settings, interleaved the same way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from course_lib.recipe_ladder.decision import MIN_GAIN, OUTLIERS, median_examples, seconds_to_target
from course_lib.recipe_ladder.rungs import RUNG_NAMES

RECIPE_ABOUT = (
    "One run of the recipe ladder (time to a fixed validation accuracy as examples to target over seeds and "
    "examples per second over interleaved rounds, rung by rung), written by `python -m course_lib.cli.recipe "
    "--json PATH`. The README's recipe section is rendered from docs/results/recipe.json by "
    "`python -m course_tools.sections render recipe` (no measuring). See docs/results/README.md."
)
SPEEDUP_TARGET = 1.5  # the recipe vs the slides' settings, time to the target
RAN = ("reference", "kept", "dropped", "within noise")  # statuses of rows that were measured


@dataclass
class RecipeConfig:
    """One ladder run (logged with ``asdict`` in the record)."""

    epochs: int = 1  # the budget of every accuracy run
    batch_size: int = 32
    lr: float = 5e-4  # x sqrt(batch multiple) on the large-batch rung; linear warm-up and decay
    weight_decay: float = 0.01
    max_length: int = 128  # rung 1 pads every batch to this
    # batches of batch_size training examples between evaluations: 2 x 32 = 64 examples, one step of the
    # large batch. Evaluated after every batch, rung 1 (seed 0) first reached the committed record's target
    # after 704 examples: one evaluation 9 % of it (the record prints its own share, eval_step_share)
    eval_every: int = 2
    train_rows: int | None = None  # None: the whole train split (rounded down to whole large batches)
    eval_rows: int | None = None  # None: the whole validation split
    tolerance_se: float = 1.0  # target = lowest final correct rows of rung 1 less this many standard errors
    seeds: int = 3  # accuracy runs per optimisation setting (seed, seed + 1, ...)
    rounds: int = 5  # interleaved throughput rounds per comparison (>= 5: an interval without the extremes)
    min_gain: float = MIN_GAIN  # the smallest gain worth changing the recipe for (decision.decide)
    warmup_steps: int = 1  # untimed steps at the start of each throughput run
    # batches of batch_size rows timed in each throughput run: the same rows for every stack (runs.timed_rows)
    timed_steps: int = 6
    large_batch: int = 2  # the large-batch rung's batch multiple
    rungs: tuple[str, ...] = RUNG_NAMES  # the rungs to run; the others get a row saying so
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
            raise ValueError("The ladder needs rung 'slides': its runs set the target and the time to beat.")
        for name in ("epochs", "batch_size", "eval_every", "large_batch", "max_length", "timed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.seeds < 3:
            raise ValueError(f"seeds must be >= 3 (a median and a range), got {self.seeds}.")
        if self.rounds < 2 * OUTLIERS + 3:
            raise ValueError(
                f"rounds must be >= {2 * OUTLIERS + 3} (an interval that leaves {OUTLIERS} round out at each "
                f"end and still has a round each side of the median), got {self.rounds}."
            )
        if not self.min_gain > 1:
            raise ValueError(
                f"min_gain must be above 1 (the smallest gain worth changing the recipe for), got {self.min_gain}."
            )
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (first-use costs), got {self.warmup_steps}.")
        if self.eval_every % self.large_batch:
            raise ValueError(
                f"eval_every ({self.eval_every}) must be a multiple of large_batch ({self.large_batch}), so that "
                "every rung evaluates after the same training examples."
            )
        if self.lr <= 0 or self.tolerance_se < 0:
            raise ValueError(
                f"lr must be positive and tolerance_se >= 0, got {self.lr} and {self.tolerance_se}."
            )


def quick_recipe_config(**overrides: Any) -> RecipeConfig:
    """The smoke-test preset: 256 rows, batch 16, no compile, short throughput rounds (under a minute)."""
    settings: dict[str, Any] = {
        "batch_size": 16,
        "lr": 1e-3,
        "eval_every": 2,
        "train_rows": 256,
        "eval_rows": 128,
        "timed_steps": 3,
        "rungs": tuple(r for r in RUNG_NAMES if r != "compile"),
    }
    return RecipeConfig(**{**settings, **overrides})


# ---------------------------------------------------------------------------------------------
# Reading a record


def setting(record: dict[str, Any], name: str) -> Any:
    """One setting of a record's run (a setting the record lacks takes ``RecipeConfig``'s default).

    Read without ``RecipeConfig``'s checks: a record written under older limits still renders.
    """
    defaults = {f.name: f.default for f in fields(RecipeConfig)}
    return record.get("config", {}).get(name, defaults[name])


def rule(record: dict[str, Any]) -> dict[str, Any] | None:
    """The decision rule a record was decided by (``decision.decide``); None: the rule before it.

    Records without ``"rule"`` were decided by the range over rounds x seeds (kept when its smallest
    gain was above 1, dropped when its largest was below 1): their text says so.
    """
    return record.get("rule")


def recipe_gain(record: dict[str, Any]) -> dict[str, float]:
    """The recipe's gain over the slides' settings: median, low, high (time to target, paired)."""
    return record["final"]["gain"]


def time_to_target(row: dict[str, Any]) -> float | None:
    """Median examples to target over median examples per second, plus one-off seconds (None: the median seed missed)."""
    examples = median_examples(row.get("examples_to_target") or [None])
    if examples is None or not row.get("examples_per_s"):
        return None
    return seconds_to_target(examples, statistics.median(row["examples_per_s"]), row.get("once_s", 0.0))


def recommended_command(record: dict[str, Any]) -> str:
    """The ``python -m course_lib.cli.train`` line that trains the record's recipe."""
    return record["final"]["command"]
