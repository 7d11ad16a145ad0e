"""``python -m course_lib.cli.recipe``: time to accuracy, one efficiency change at a time (README, "Time to accuracy").

The slides' loop sets a target validation accuracy; each rung of the ladder adds one change and is
timed to the same target (``course_lib.benchmark.recipe``). ``--quick`` is a one-minute smoke run;
``--json``/``--readme`` write the record and the README section; ``--from-json`` renders without measuring.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from course_lib.benchmark.recipe import (
    MEASURE_COMMAND,
    RECIPE,
    RECIPE_RECORD,
    RecipeConfig,
    markdown_report,
    plot,
    quick_config,
    run_ladder,
    write_readme_section,
)
from course_lib.benchmark.rungs import RUNG_NAMES
from course_lib.cli import comma_list
from course_lib.devices import describe_machine, format_machine
from course_lib.tooling import sections


def parse_args(argv: list[str] | None = None) -> tuple[RecipeConfig, argparse.Namespace]:
    """Command-line flags into a ``RecipeConfig`` (``--quick`` sets a preset the other flags override)."""
    p = argparse.ArgumentParser(
        prog="python -m course_lib.cli.recipe",
        description="Fine-tune the course model to a fixed validation accuracy, adding one efficiency change "
        "per rung (dynamic padding, length grouping, fused AdamW, SDPA, mixed precision, torch.compile, a "
        "larger batch); report each rung's wall time to the target and the fastest stack on this machine.",
        epilog="The target is the slides' loop's final accuracy on the budget, less --tolerance. Evaluation "
        "time is not counted.",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 256 rows, 1 epoch, no compile, no memory"
    )
    p.add_argument("--epochs", type=int, help="the budget of every rung")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=int, help="optimizer steps (at --batch-size) between evaluations")
    p.add_argument("--train-rows", type=int)
    p.add_argument("--eval-rows", type=int)
    p.add_argument("--tolerance", type=float, help="target = the slides' loop's final accuracy minus this")
    p.add_argument("--target", type=float, help="a fixed target accuracy instead")
    p.add_argument("--large-batch", type=int, help="batch multiple of the last rung")
    p.add_argument("--rungs", type=comma_list, help=f"comma-separated, from {', '.join(RUNG_NAMES)}")
    p.add_argument(
        "--stop-at-target", action="store_true", help="end each rung after rung 1 on reaching the target"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument("--memory", action="store_true", help="measure peak memory even with --quick")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, mps")
    sections.add_writer_arguments(p, RECIPE, RECIPE_RECORD, plot="the ladder chart")
    args = p.parse_args(argv)
    names = ("epochs", "batch_size", "lr", "eval_every", "train_rows", "eval_rows", "tolerance", "target")
    names += ("large_batch", "rungs", "seed", "device")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.stop_at_target:
        overrides["stop_at_target"] = True
    if args.no_memory:
        overrides["memory"] = False
    elif args.memory:
        overrides["memory"] = True
    cfg = quick_config(**overrides) if args.quick else RecipeConfig(**overrides)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_args(argv)
        readmes = args.readme or []
        sections.check_writer_args(readmes, RECIPE, RECIPE_RECORD, args.check, args.from_json, args.json)
        if args.from_json:
            record = sections.load_record(args.from_json, MEASURE_COMMAND)
        else:
            print(format_machine(describe_machine()))
            print(f"\nconfig: {asdict(cfg)}\n", flush=True)
            record = run_ladder(cfg, log=lambda line: print(line, flush=True))
        report = markdown_report(record)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        return sections.report_drift(
            readmes, RECIPE, report, args.from_json, "python -m course_lib.cli.recipe"
        )
    if not args.from_json:
        print("\n" + report)
        json_path = args.json or (RECIPE_RECORD if readmes else None)
        if json_path:
            sections.write_record(json_path, record)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report, encoding="utf-8")
    if args.plot:
        plot(record, args.plot)
    for path in readmes:
        write_readme_section(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
