"""``python -m course_lib.cli.experiments``: what pretraining buys, measured; README's "pretrained" block.

It prints the masked-LM table and the fine-tuning table of ``course_lib.demos.pretraining``. With
``--readme README.md`` it also records the run in ``docs/results/pretrained.json`` (``--json`` for
another path) and renders README's block between ``<!-- pretrained:start -->`` and
``<!-- pretrained:end -->`` from that record; ``--from-json docs/results/pretrained.json --readme
README.md`` renders it again without measuring, and ``--check`` only compares (exit 1 on drift).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from course_lib.demos.pretraining import (
    RUNS,
    ComparisonConfig,
    compare_masked_lm,
    markdown_table,
    masked_lm_table,
    pretrained_vs_scratch,
)
from course_lib.tooling import sections

PRETRAINED = "pretrained"  # README block
PRETRAINED_RECORD = Path("docs/results/pretrained.json")
RENDER_COMMAND = f"python -m course_lib.cli.experiments --from-json {PRETRAINED_RECORD} --readme README.md"
MEASURE_COMMAND = "python -m course_lib.cli.experiments --readme README.md"
PRETRAINED_ABOUT = (
    "What pretraining buys: masked-LM accuracy and fine-tuning from the checkpoint vs random init, written by "
    "`python -m course_lib.cli.experiments --readme README.md`. README's pretrained block is rendered from it; "
    f"`{RENDER_COMMAND}` renders it again without measuring. See docs/results/README.md."
)


def make_record(mlm: dict[str, float], result: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of one run (``compare_masked_lm`` and ``pretrained_vs_scratch``), dated, with the machine."""
    from course_lib.devices import cpu_name, get_device

    keep = ("accuracy", "f1", "eval_loss", "seconds")
    return {
        "about": PRETRAINED_ABOUT,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "device": str(get_device())},
        "masked_lm": dict(mlm),
        "fine_tuning": {
            "config": result["config"],
            "majority_accuracy": result["majority_accuracy"],
            **{run: {k: result[run][k] for k in keep} for run in RUNS},
        },
    }


def _machine_text(machine: dict[str, Any]) -> str:
    cores, cpu, device = machine.get("cores"), machine.get("cpu"), machine.get("device", "cpu")
    parts = [cpu] if cpu else []
    if cores:
        parts.append(f"{cores} cores" if cpu else f"{cores}-core CPU")
    if device != "cpu":
        parts.append(f"device {device}")
    return ", ".join(parts)


def render_report(record: dict[str, Any]) -> str:
    """README's pretrained block from a record: when and where, the masked-LM and fine-tuning tables."""
    when = ", ".join(p for p in (record.get("date"), _machine_text(record.get("machine", {}))) if p)
    header = "What pretraining buys, measured by `python -m course_lib.cli.experiments`" + (
        f" ({when})" if when else ""
    )
    return (
        f"{header}:\n\nMasked-LM (the pretraining task) on held-out pairs:\n\n{masked_lm_table(record['masked_lm'])}"
        f"\n\nFine-tuning on the paraphrase task, same budget for both starts:\n\n"
        f"{markdown_table(record['fine_tuning'])}\n"
    )


def check_committed(root: Path = Path(".")) -> list[str]:
    """Drift of README's pretrained block against ``docs/results/pretrained.json``."""
    record = sections.load_record(root / PRETRAINED_RECORD, MEASURE_COMMAND)
    problem = sections.check_block(root / "README.md", PRETRAINED, render_report(record), RENDER_COMMAND)
    return [problem] if problem else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Pretrained checkpoint vs random init: masked-LM and fine-tuning."
    )
    defaults = ComparisonConfig()
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--precision", default=defaults.precision, help="no (fp32), bf16 or fp16")
    parser.add_argument("--train-rows", type=int, default=None, help="first N training rows (default: all)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--model", default=None, help="hub id or folder (default: COURSE_MODEL / embedded)")
    parser.add_argument("--mlm-pairs", type=int, default=200, help="held-out pairs for the masked-LM check")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument(
        "--readme", type=Path, help=f"render the results between the {PRETRAINED} markers of this file"
    )
    parser.add_argument(
        "--json",
        type=Path,
        help=f"write the run's record here (with --readme the default is {PRETRAINED_RECORD})",
    )
    parser.add_argument("--from-json", type=Path, help="render from this record instead of measuring")
    parser.add_argument("--check", action="store_true", help="with --readme: only compare, exit 1 on drift")
    args = parser.parse_args(argv)
    try:
        if args.check and not args.readme:
            raise ValueError("--check compares a file with the record: name it with --readme README.md.")
        if args.readme:
            sections.read_block(
                args.readme, PRETRAINED
            )  # a missing file or bad markers: say so before measuring
        if args.from_json:
            if args.json:
                raise ValueError("--json writes a new measurement; with --from-json nothing is measured.")
            record = sections.load_record(args.from_json, MEASURE_COMMAND)
        else:
            if args.check:
                raise ValueError(f"--check compares with a record: add --from-json {PRETRAINED_RECORD}.")
            mlm = compare_masked_lm(args.model, pairs=args.mlm_pairs, seed=args.seed)
            result = pretrained_vs_scratch(
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                precision=args.precision,
                train_rows=args.train_rows,
                seed=args.seed,
                model_name=args.model,
                progress=not args.no_progress,
            )
            record = make_record(mlm, result)
            json_path = args.json or (PRETRAINED_RECORD if args.readme else None)
            if json_path:
                sections.write_record(json_path, record)
        report = render_report(record)
        if args.readme and args.check:
            fix = f"python -m course_lib.cli.experiments --from-json {args.from_json} --readme {args.readme}"
            problem = sections.check_block(args.readme, PRETRAINED, report, fix)
            if problem:
                print(problem, file=sys.stderr)
                return 1
            print(f"{args.readme}: the {PRETRAINED} section is up to date with {args.from_json}")
            return 0
        if args.readme:
            sections.write_block(args.readme, PRETRAINED, report)
    except (ValueError, FileNotFoundError, ConnectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not (args.from_json and args.readme):
        print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
