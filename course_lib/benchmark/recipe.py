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
decision, keep / drop / within noise, and its reasons: ``ladder_runs.decide``. The recommended recipe
is the last kept stack; it is measured once more against the slides' settings, interleaved the same way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from course_lib.benchmark.ladder_runs import MIN_GAIN, OUTLIERS, seconds_to_target, spread
from course_lib.benchmark.ladder_runs import run_ladder as ladder_run
from course_lib.benchmark.report import format_cell
from course_lib.benchmark.rungs import RUNG_NAMES

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
    eval_every: int = 8  # batches of batch_size training examples between evaluations
    train_rows: int | None = None  # None: the whole train split (rounded down to whole large batches)
    eval_rows: int | None = None  # None: the whole validation split
    tolerance_se: float = 1.0  # target = lowest final correct rows of rung 1 less this many standard errors
    seeds: int = 3  # accuracy runs per optimisation setting (seed, seed + 1, ...)
    rounds: int = 5  # interleaved throughput rounds per comparison (>= 5: an interval without the extremes)
    min_gain: float = MIN_GAIN  # the smallest gain worth changing the recipe for (ladder_runs.decide)
    warmup_steps: int = 1  # untimed steps at the start of each throughput run
    # batches of batch_size rows timed in each throughput run: the same rows for every stack (rungs.timed_rows)
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


def quick_config(**overrides: Any) -> RecipeConfig:
    """The smoke-test preset: 256 rows, batch 16, no compile, short throughput rounds (under a minute)."""
    settings: dict[str, Any] = {
        "batch_size": 16,
        "lr": 1e-3,
        "eval_every": 4,
        "train_rows": 256,
        "eval_rows": 128,
        "timed_steps": 3,
        "rungs": tuple(r for r in RUNG_NAMES if r != "compile"),
    }
    return RecipeConfig(**{**settings, **overrides})


def run_ladder(cfg: RecipeConfig, log=print, measure=None) -> dict[str, Any]:
    """Run the ladder per ``cfg`` (``ladder_runs.run_ladder``); return its record, ready to write."""
    return {"about": RECIPE_ABOUT, **ladder_run(cfg, log, measure)}


# ---------------------------------------------------------------------------------------------
# Reading a record


def setting(record: dict[str, Any], name: str) -> Any:
    """One setting of a record's run (a setting the record lacks takes ``RecipeConfig``'s default).

    Read without ``RecipeConfig``'s checks: a record written under older limits still renders.
    """
    defaults = {f.name: f.default for f in fields(RecipeConfig)}
    return record.get("config", {}).get(name, defaults[name])


def rule(record: dict[str, Any]) -> dict[str, Any] | None:
    """The decision rule a record was decided by (``ladder_runs.decide``); None: the rule before it.

    Records without ``"rule"`` were decided by the range over rounds x seeds (kept when its smallest
    gain was above 1, dropped when its largest was below 1): their text says so.
    """
    return record.get("rule")


def _spread_word(record: dict[str, Any]) -> str:
    return "interval" if rule(record) else "range"


def gain_rule_sentence(record: dict[str, Any]) -> str:
    """How the record's gains were formed and decided, in one paragraph of the report."""
    r = rule(record)
    if r is None:
        return (
            "Gain: time to target of the stack before over the rung's, over rounds x seeds; a rung is kept "
            "only when its whole range is above 1."
        )
    k = r["outliers"]
    left_out = (
        "the smallest and the largest round" if k == 1 else f"the {k} smallest and the {k} largest rounds"
    )
    return (
        f"Gain: time to target of the stack before over the rung's, one per round (that round's two "
        f"throughputs, the seed medians of examples to target); its median over the {r['rounds']} rounds and "
        f"the interval that leaves {left_out} out (a "
        f"distribution-free {r['interval_coverage']:.1%} interval for the median round: one outlying round "
        f"moves neither end past the next). A rung is kept when its median gain is at least {r['min_gain']:.2f}x "
        f"(the smallest gain worth changing the recipe for, stated in advance) and its interval lies above 1, "
        f"dropped when the median is at most {1 / r['min_gain']:.2f}x with the interval below 1 or when a seed "
        "misses the target, and within noise (not kept) otherwise."
    )


def _names(rows: list[dict[str, Any]], statuses: tuple[str, ...], why: bool = False) -> str:
    found = [
        f"{r['rung']} {r['name']}" + (f" ({r['reason']})" if why else "")
        for r in rows
        if r["status"] in statuses
    ]
    return ", ".join(found) or "none"


def recipe_gain(record: dict[str, Any]) -> dict[str, float]:
    """The recipe's gain over the slides' settings: median, low, high (time to target, paired)."""
    return record["final"]["gain"]


def verdict(record: dict[str, Any]) -> list[str]:
    """Which rungs paid here, which did not, the recipe, its gain over rung 1, target met or not."""
    rows, gain, r = record["rows"], recipe_gain(record), rule(record)
    word = _spread_word(record)
    ok = gain["low"] >= SPEEDUP_TARGET
    if ok:
        short = ""
    elif gain["median"] >= SPEEDUP_TARGET:
        short = f"; its median is above {SPEEDUP_TARGET}x but its {word} reaches below"
    else:
        short = f"; short of it: kept {_names(rows, ('kept',))}; not kept {_names(rows, ('dropped', 'within noise'))}"
    kept = f"median gain >= {r['min_gain']:.2f}x, interval above 1" if r else "gain above the measured spread"
    return [
        f"Kept ({kept}): {_names(rows, ('kept',))}.",
        f"Within noise (not kept): {_names(rows, ('within noise',))}.",
        f"Dropped (slower, or the target missed): {_names(rows, ('dropped',))}.",
        f"Not run: {_names(rows, ('skipped', 'not run'), why=True)}.",
        f"Recommended recipe here: {record['final']['recipe']}: {gain['median']:.2f}x sooner to the target than "
        f"the slides' settings ({word} {gain['low']:.2f}-{gain['high']:.2f}x; target >= {SPEEDUP_TARGET}x over the "
        f"whole {word}: {'met' if ok else 'MISSED'}){short}.",
        f"Reproduce it: `{record['final']['command']}`.",
    ]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return format_cell(value, spec, suffix, missing="-")  # a rung that did not run: "-"


def _range(s: dict[str, float] | None, spec: str, suffix: str = "") -> str:
    if not s:
        return "-"
    return f"{s['median']:{spec}}{suffix} ({s['low']:{spec}}-{s['high']:{spec}})"


def _examples(values: list[int | None] | None) -> str:
    if not values:
        return "-"
    reached = [v for v in values if v is not None]
    missed = len(values) - len(reached)
    text = _range(spread(reached), ",.0f") if reached else "never"
    return text + (f", {missed} missed" if missed and reached else "")


COLUMNS = (
    "rung",
    "change",
    "status",
    "examples/s",
    "vs stack before",
    "examples to target",
    "gain",
    "time to target (s)",
    "real tokens/s",
)


def time_to_target(row: dict[str, Any]) -> float | None:
    """Median examples to target over median examples per second, plus one-off seconds."""
    reached = [v for v in row.get("examples_to_target") or [] if v is not None]
    # a seed that missed the target: no time to target (as decide drops the rung)
    if not reached or not row.get("examples_per_s") or len(reached) < len(row["examples_to_target"]):
        return None
    return seconds_to_target(
        statistics.median(reached), statistics.median(row["examples_per_s"]), row.get("once_s", 0.0)
    )


def markdown_table(record: dict[str, Any]) -> str:
    """One line per rung: its change, status, the two factors with their spreads, the gain."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in record["rows"]:
        status = r["status"] if r["status"] in ("reference", "kept") else f"{r['status']}: {r['reason']}"
        examples = _examples(r.get("examples_to_target"))
        if r.get("same_function"):
            examples += " (same function: the stack before's)"
        cells = [
            r["rung"],
            r["label"],
            status,
            _range(spread(r["examples_per_s"]) if r.get("examples_per_s") else None, ",.1f"),
            _range(r.get("throughput_ratio"), ".2f", "x"),
            examples,
            _range(r.get("gain"), ".2f", "x"),
            _fmt(time_to_target(r), ",.1f"),
            _fmt(r.get("real_tokens_per_s"), ",.0f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def target_sentence(record: dict[str, Any]) -> str:
    """The target in validation rows, against the binomial standard error."""
    t, n = record["target"], record["eval_rows"]
    return (
        f"validation accuracy >= {t['accuracy']:.3f} ({t['correct']} of {n:,} rows): the lowest final accuracy of "
        f"the slides' settings over {len(record['seeds'])} seeds ({t['lowest_final_correct']} rows) less "
        f"{t['tolerance_rows']} rows, {setting(record, 'tolerance_se'):g} binomial standard error "
        f"(sqrt(p(1 - p) / n) = {t['standard_error']:.3f}, {t['standard_error'] * n:.1f} rows)"
    )


def _timed_sentence(record: dict[str, Any]) -> str:
    """What each throughput run timed; records without ``timed_rows`` timed the epoch's first batches."""
    if record.get("timed_rows"):
        return (
            f"the same {record['timed_rows']:,} training rows for every stack (drawn at random once), "
            "each stack in its own batches"
        )
    return f"{setting(record, 'timed_steps')} timed steps (the epoch's first batches of each stack)"


def markdown_report(record: dict[str, Any]) -> str:
    """The README section: how it was measured, the table, the verdict."""
    load, machine = record.get("load_average") or [], record["machine"]
    if len(load) == 2 and None not in load:
        machine += f" (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        machine += f", {record['cores']} cores)" if record.get("cores") else ")"
    batch, every = setting(record, "batch_size"), setting(record, "eval_every")
    header = (
        f"Measured on {machine}, {record['date']}; the whole run took {record['seconds'] / 60:.1f} min. "
        f"Target: {target_sentence(record)}. Every run: the same {record['train_rows']:,} training pairs, "
        f"{setting(record, 'epochs')} epoch(s), batch {batch}, lr {setting(record, 'lr'):g} (linear warm-up and "
        f"decay) through the course loop, an evaluation every {every * batch:,} training examples. Examples to "
        f"target: median (range) over seeds {', '.join(map(str, record['seeds']))}, measured for the rungs that "
        "change the optimisation; the others compute the same function and take the stack before's. Examples/s: "
        f"median (range) over {setting(record, 'rounds')} rounds of {_timed_sentence(record)} "
        f"after {setting(record, 'warmup_steps')} untimed step(s), each rung interleaved with the stack before it"
        + ("; vs stack before: the per-round ratio, median (interval). " if rule(record) else ". ")
        + gain_rule_sentence(record)
        + " Time to target: training only (evaluation not counted), compilation included."
    )
    return (
        f"{header}\n\n{markdown_table(record)}\n\n"
        + "\n".join(f"- {line}" for line in verdict(record))
        + "\n"
    )


def plot(record: dict[str, Any], path: str | Path | None = None, ax=None):
    """The ladder as bars: each rung's gain over the stack before it, with its interval (range, in older records)."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")  # a file, not a window: no display needed (before pyplot is imported)
    import matplotlib.pyplot as plt

    rows, fig = [r for r in record["rows"][1:] if r.get("gain")], None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"kept": "#2a9d8f", "dropped": "#e76f51", "within noise": "#e9c46a"}
    medians = [r["gain"]["median"] for r in rows]
    errors = [
        [m - r["gain"]["low"] for m, r in zip(medians, rows)],
        [r["gain"]["high"] - m for m, r in zip(medians, rows)],
    ]
    ax.bar(range(len(rows)), medians, yerr=errors, capsize=4, color=[colors[r["status"]] for r in rows])
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(
        range(len(rows)), [f"{r['rung']} {r['name']}" for r in rows], rotation=30, ha="right", fontsize=8
    )
    ax.set_ylabel("gain over the stack before (x)")
    ax.set_title(
        f"Time-to-target gain per rung, median and {_spread_word(record)} (green kept, yellow within noise, red dropped)",
        fontsize=8,
    )
    if rule(record):
        ax.axhline(rule(record)["min_gain"], color="#2a9d8f", lw=0.8, ls="--")
        ax.axhline(1 / rule(record)["min_gain"], color="#e76f51", lw=0.8, ls="--")
    if fig is not None:
        fig.tight_layout()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
            plt.close(fig)
    return ax
