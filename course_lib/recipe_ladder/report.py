"""The ladder's record as text: the README section (``recipe_report``), its table, the verdict, the chart,
and the flat rows lesson 07 prints (``throughput_rows``, ``examples_rows``, ``decision_rows``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from course_lib.benchmark.report import format_cell
from course_lib.recipe_ladder.decision import median_examples, spread
from course_lib.recipe_ladder.recipe import SPEEDUP_TARGET, recipe_gain, rule, setting, time_to_target


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
        f"dropped when the median is at most {1 / r['min_gain']:.2f}x with the interval below 1 or when "
        + (
            "the median seed misses the target or a seed ends more than one standard error under it (a seed that "
            "missed counts as later than every seed that reached it), "
            if r.get("misses")
            else "a seed misses the target, "
        )
        + "and within noise (not kept) otherwise."
    )


def _names(rows: list[dict[str, Any]], statuses: tuple[str, ...], why: bool = False) -> str:
    found = [
        f"{r['rung']} {r['name']}" + (f" ({r['reason']})" if why else "")
        for r in rows
        if r["status"] in statuses
    ]
    return ", ".join(found) or "none"


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


LADDER_COLUMNS = (
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


def ladder_table(record: dict[str, Any]) -> str:
    """One line per rung: its change, status, the two factors with their spreads, the gain."""
    lines = ["| " + " | ".join(LADDER_COLUMNS) + " |", "|" + "---|" * len(LADDER_COLUMNS)]
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


def recipe_report(record: dict[str, Any]) -> str:
    """The README section: how it was measured, the table, the verdict."""
    load, machine = record.get("load_average") or [], record["machine"]
    if len(load) == 2 and None not in load:
        machine += f" (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        machine += f", {record['cores']} cores)" if record.get("cores") else ")"
    if "omp_wait_policy" in record:  # records before it do not say
        machine += f", OMP_WAIT_POLICY={record['omp_wait_policy'] or 'unset'}"
    batch, every = setting(record, "batch_size"), setting(record, "eval_every")
    share = record["target"].get("eval_step_share")
    resolved = f" ({share:.0%} of rung 1's median examples to target)" if share is not None else ""
    header = (
        f"Measured on {machine}, {record['date']}; the whole run took {record['seconds'] / 60:.1f} min. "
        f"Target: {target_sentence(record)}. Every run: the same {record['train_rows']:,} training pairs, "
        f"{setting(record, 'epochs')} epoch(s), batch {batch}, lr {setting(record, 'lr'):g} (linear warm-up and "
        f"decay) through the course loop, an evaluation every {every * batch:,} training examples{resolved}. Examples to "
        f"target: median (range) over seeds {', '.join(map(str, record['seeds']))}, measured for the rungs that "
        "change the optimisation; the others compute the same function and take the stack before's. Examples/s: "
        f"median (range) over {setting(record, 'rounds')} rounds of {_timed_sentence(record)} "
        f"after {setting(record, 'warmup_steps')} untimed step(s), each rung interleaved with the stack before it"
        + ("; vs stack before: the per-round ratio, median (interval). " if rule(record) else ". ")
        + gain_rule_sentence(record)
        + " Time to target: training only (evaluation not counted), compilation included."
    )
    return (
        f"{header}\n\n{ladder_table(record)}\n\n" + "\n".join(f"- {line}" for line in verdict(record)) + "\n"
    )


def plot_ladder(record: dict[str, Any], path: str | Path | None = None, ax=None):
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


# ---------------------------------------------------------------------------------------------
# Flat rows for a notebook table (``tables.render_table``): one call prints each view of the record


def _rung(r: dict[str, Any]) -> str:
    return f"{r['rung']} {r['name']}"


def decision_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rung: the code it sets, the machine's load when it started, its status, gain and reason."""
    return [
        {
            "rung": _rung(r),
            "sets": r["label"] if r["status"] == "reference" else r.get("sets", "-"),  # rung 1: the baseline
            "load": "-" if r.get("load_average") is None else f"{r['load_average']:.1f}",
            "status": r["status"],
            "gain": _range(r.get("gain"), ".2f", "x"),
            "reason": r["reason"],
        }
        for r in record["rows"]
    ]


def throughput_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per measured rung: examples/s per round, their median, the per-round ratio to the stack before."""
    out = []
    for r in (r for r in record["rows"] if r.get("examples_per_s")):
        before = r.get("before_examples_per_s")
        ratios = [t / p for p, t in zip(before, r["examples_per_s"])] if before else []
        out.append(
            {
                "rung": _rung(r),
                "examples/s per round": " ".join(f"{x:.0f}" for x in r["examples_per_s"]),
                "median": f"{spread(r['examples_per_s'])['median']:.0f}",
                "ratio to the stack before per round": " ".join(f"{x:.2f}x" for x in ratios) or "-",
                "median ratio (interval)": _range(r.get("throughput_ratio"), ".2f", "x"),
            }
        )
    return out


def examples_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rung with accuracy runs: examples to target per seed, their median, best correct rows per seed."""
    out = []
    for r in (r for r in record["rows"] if r.get("accuracy_runs")):
        runs, examples = r["accuracy_runs"], r["examples_to_target"]
        middle = median_examples(examples)
        out.append(
            {
                "rung": _rung(r),
                **{f"seed {run['seed']}": "missed" if e is None else e for run, e in zip(runs, examples)},
                "median": "missed" if middle is None else f"{middle:g}",
                "best correct per seed": " ".join(
                    str(max(e["correct"] for e in run["evals"])) for run in runs
                ),
            }
        )
    return out


def target_line(record: dict[str, Any]) -> str:
    """The target, its standard error and how finely the evaluations resolve the examples to it."""
    t = record["target"]
    line = f"target: {target_sentence(record)}"
    if "eval_step" in t:
        line += f"; one evaluation every {t['eval_step']} examples = {t['eval_step_share']:.0%} of rung 1's median"
    return line


def plot_accuracy_runs(record: dict[str, Any], ax) -> None:
    """Validation accuracy against training examples seen, every accuracy run, and the target."""
    for r in record["rows"]:
        for run in r.get("accuracy_runs", []):
            examples, accuracy = [e["examples"] for e in run["evals"]], [e["accuracy"] for e in run["evals"]]
            ax.plot(examples, accuracy, marker="o", ms=3, alpha=0.8, label=f"{_rung(r)} (seed {run['seed']})")
    ax.axhline(record["target"]["accuracy"], color="black", ls="--", lw=1, label="target")
    ax.set_xlabel("training examples seen")
    ax.set_ylabel("validation accuracy")
    ax.legend(fontsize=6, ncol=2)
