"""``python -m course_lib.cli.recipe``: time to accuracy, one efficiency change at a time (README, "Time to accuracy").

The slides' settings set a target validation accuracy; each rung of the ladder adds one change, and
its time to the target is measured as examples to target (over seeds) over examples per second (in
interleaved rounds) (``course_lib.recipe_ladder``). The last line printed is the recommended recipe
as one ``python -m course_lib.cli.train`` command. ``--quick`` is a smoke run; ``--json`` writes
the run's record, ``--markdown`` and ``--plot`` its report.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from course_lib.benchmark.report import save_record
from course_lib.cli import add_output_arguments, comma_list
from course_lib.devices import describe_machine, format_machine
from course_lib.recipe_ladder.ladder_runs import run_ladder
from course_lib.recipe_ladder.recipe import RecipeConfig, quick_recipe_config
from course_lib.recipe_ladder.report import plot_ladder, recipe_report
from course_lib.recipe_ladder.rungs import RUNG_NAMES


def parse_args(argv: list[str] | None = None) -> tuple[RecipeConfig, argparse.Namespace]:
    """Command-line flags into a ``RecipeConfig`` (``--quick`` sets a preset the other flags override)."""
    p = argparse.ArgumentParser(
        prog="python -m course_lib.cli.recipe",
        description="Fine-tune the course model to a fixed validation accuracy, adding one efficiency change "
        "per rung (dynamic padding, length grouping, fused AdamW, SDPA, mixed precision, torch.compile, a "
        "larger batch); keep a rung only when its median time-to-target gain over interleaved rounds is at least "
        "--min-gain and its interval (without the extreme rounds) lies above 1.",
        epilog="The target is the lowest final accuracy of the slides' settings over --seeds seeds, less "
        "--tolerance-se binomial standard errors. Evaluation time is not counted.",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 256 rows, 1 epoch, no compile, short rounds"
    )
    p.add_argument("--epochs", type=int, help="the budget of every rung")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=int, help="batches (of --batch-size) between evaluations")
    p.add_argument("--train-rows", type=int)
    p.add_argument("--eval-rows", type=int)
    p.add_argument("--tolerance-se", type=float, help="binomial standard errors below rung 1's lowest final")
    p.add_argument("--seeds", type=int, help="accuracy runs per optimisation setting (>= 3)")
    p.add_argument(
        "--rounds", type=int, help="interleaved throughput rounds per comparison (>= 5, default 5)"
    )
    p.add_argument(
        "--min-gain",
        type=float,
        help="the smallest time-to-target gain worth changing the recipe for (default 1.05): kept needs a median "
        "gain at least this with its interval above 1",
    )
    p.add_argument(
        "--timed-steps",
        type=int,
        help="batches of --batch-size rows timed per throughput run (the same rows for every stack)",
    )
    p.add_argument("--large-batch", type=int, help="batch multiple of the last rung")
    p.add_argument("--rungs", type=comma_list, help=f"comma-separated, from {', '.join(RUNG_NAMES)}")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, mps")
    add_output_arguments(p, plot="the ladder chart")
    args = p.parse_args(argv)
    names = ("epochs", "batch_size", "lr", "eval_every", "train_rows", "eval_rows", "tolerance_se", "seeds")
    names += ("rounds", "min_gain", "timed_steps", "large_batch", "rungs", "seed", "device")
    # only the flags given: the rest keep the preset's (--quick) or RecipeConfig's values
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    cfg = quick_recipe_config(**overrides) if args.quick else RecipeConfig(**overrides)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_machine(describe_machine()))
    print(f"\nconfig: {asdict(cfg)}\n", flush=True)
    record = run_ladder(cfg, log=lambda line: print(line, flush=True))  # a failing rung raises
    report = recipe_report(record)  # what a committed record renders into the README, too
    print("\n" + report)
    print(f"recommended recipe: {record['final']['command']}")
    if args.json:
        save_record(args.json, record)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report, encoding="utf-8")
    if args.plot:
        plot_ladder(record, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
