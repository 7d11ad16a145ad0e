"""``python -m course_tools.experiments``: what pretraining buys, measured; README's "pretrained" block.

It prints the masked-LM table and the fine-tuning table of ``course_lib.apparatus.pretraining`` and records
the run in ``docs/results/pretrained.json`` (``--json`` for another path); ``python -m
course_tools.sections render pretrained`` puts README's block between ``<!-- pretrained:start -->`` and
``<!-- pretrained:end -->`` from that record.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from course_lib.apparatus.pretraining import (
    RUNS,
    ComparisonConfig,
    compare_masked_lm,
    fine_tuning_table,
    masked_lm_table,
    pretrained_vs_scratch,
)
from course_tools import sections

PRETRAINED_RECORD = Path("docs/results/pretrained.json")
PRETRAINED_ABOUT = (
    "What pretraining buys: masked-LM accuracy and fine-tuning from the checkpoint vs random init, written by "
    "`python -m course_tools.experiments`. README's pretrained block is rendered from it by "
    "`python -m course_tools.sections render pretrained` (no measuring). See docs/results/README.md."
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
    header = "What pretraining buys, measured by `python -m course_tools.experiments`" + (
        f" ({when})" if when else ""
    )
    return (
        f"{header}:\n\nMasked-LM (the pretraining task) on held-out pairs:\n\n{masked_lm_table(record['masked_lm'])}"
        f"\n\nFine-tuning on the paraphrase task, same budget for both starts:\n\n"
        f"{fine_tuning_table(record['fine_tuning'])}\n"
    )


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
        "--json",
        type=Path,
        default=PRETRAINED_RECORD,
        help=f"write the run's record here ({PRETRAINED_RECORD})",
    )
    args = parser.parse_args(argv)
    try:
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
    except (ValueError, FileNotFoundError, ConnectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    record = make_record(mlm, result)
    sections.write_record(args.json, record)
    print(render_report(record))
    print(f"record: {args.json}; README block: python -m course_tools.sections render pretrained")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
