"""``python -m course_lib.cli.bench``: the training benchmark (docs/benchmark.md).

Four implementations of the same fine-tuning step side by side (``course_lib.benchmark``); ``--quick`` is a
one-minute smoke run; ``--json`` writes the run's record, ``--markdown`` and ``--plot`` its report.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from course_lib.benchmark.config import (
    IMPLEMENTATIONS,
    MODEL_SIZES,
    BenchConfig,
    quick_config,
)
from course_lib.benchmark.harness import run_benchmark
from course_lib.benchmark.report import (
    make_record,
    plot,
    report_from_record,
    save_record,
    target_checks,
)
from course_lib.cli import add_output_arguments, comma_list
from course_lib.devices import (
    describe_machine,
    format_machine,
)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    """Command-line flags into a ``BenchConfig`` (``--quick`` sets a preset the other flags override)."""
    p = argparse.ArgumentParser(
        prog="python -m course_lib.cli.bench",
        description="Training throughput of a PyTorch loop, Accelerator, Trainer and course_lib.cli.train: "
        "same model, data, batch shapes and seed, interleaved runs.",
        epilog="What each column means and how it is measured: docs/benchmark.md.",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, fp32+bf16, few steps")
    p.add_argument("--sizes", type=comma_list, help=f"comma-separated, from {', '.join(MODEL_SIZES)}")
    p.add_argument("--precisions", type=comma_list, help="comma-separated from no (fp32), bf16, fp16")
    p.add_argument(
        "--implementations", type=comma_list, help=f"comma-separated, from {', '.join(IMPLEMENTATIONS)}"
    )
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--steps", type=int, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, help="untimed optimizer steps at the start of every run")
    p.add_argument("--rounds", type=int, help="interleaved repetitions")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, mps")
    p.add_argument("--no-memory", action="store_true", help="skip peak memory (2 extra steps per row)")
    p.add_argument("--memory", action="store_true", help="measure peak memory even with --quick")
    add_output_arguments(p, plot="a bar chart")
    args = p.parse_args(argv)
    overrides = {
        name: getattr(args, name)
        for name in (
            "sizes",
            "precisions",
            "implementations",
            "batch_size",
            "seq_len",
            "steps",
            "warmup",
            "rounds",
            "lr",
            "seed",
            "device",
        )
        if getattr(args, name) is not None  # only the flags given: the preset's values for the rest
    }
    if args.no_memory:  # wins over --memory
        overrides["memory"] = False
    elif args.memory:
        overrides["memory"] = True
    cfg = quick_config(**overrides) if args.quick else BenchConfig(**overrides)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_args(argv)
        print(format_machine(describe_machine()))
        print(f"\nconfig: {asdict(cfg)}\n")
        start = time.perf_counter()
        rows = run_benchmark(cfg)
        record = make_record(rows, cfg, time.perf_counter() - start)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = report_from_record(record)  # what a committed record renders into the README, too
    checks = target_checks(record["rows"])
    print("\n" + report)
    if checks:
        print("Targets:\n" + "\n".join(f"- {line}" for line in checks))
    print(f"\nbenchmark took {record['seconds']:.0f} s")
    if args.json:
        save_record(args.json, record)
    if args.markdown:
        text = report + ("\nTargets:\n\n" + "\n".join(f"- {c}" for c in checks) + "\n" if checks else "")
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(record["rows"], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
