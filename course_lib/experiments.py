"""Experiments the lessons run and the README reports: ``python -m course_lib.experiments``.

``pretrained_vs_scratch`` fine-tunes the same architecture twice on the same data, budget and seed:
once from the pretrained checkpoint (``from_pretrained``) and once from random weights
(``from_config``). The gap between the two is what pretraining buys.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from course_lib import data, models, training
from course_lib.devices import normalize_precision, seed_everything

RUNS = ("pretrained", "scratch")


@dataclass
class ComparisonConfig:
    """Budget of the pretrained-vs-scratch comparison (the same for both runs)."""

    epochs: int = 3
    batch_size: int = 32
    lr: float = 3e-4
    precision: str = "no"
    train_rows: int | None = None  # None: the whole train split
    eval_rows: int | None = None  # None: the whole validation split
    seed: int = 0
    model_name: str | None = None  # None: the COURSE_MODEL switch (embedded by default)

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")
        self.precision = normalize_precision(self.precision)


def majority_accuracy(labels) -> float:
    """Accuracy of always predicting the most frequent label: the bar a classifier must clear."""
    share = data.label_balance(int(x) for x in labels)
    return max(share, 1.0 - share)


def pretrained_vs_scratch(
    epochs: int = 3,
    batch_size: int = 32,
    lr: float = 3e-4,
    precision: str = "no",
    train_rows: int | None = None,
    seed: int = 0,
    eval_rows: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune from the pretrained checkpoint and from random init on the same budget.

    Returns ``{"config", "majority_accuracy", "pretrained", "scratch", "histories"}`` where each
    run is ``{"accuracy", "f1", "eval_loss", "losses", "evals", "seconds"}`` (final validation
    metrics, per-step training losses, per-epoch evaluations) and ``histories`` holds the two
    ``training.History`` objects.
    """
    cfg = ComparisonConfig(epochs, batch_size, lr, precision, train_rows, eval_rows, seed, model_name)
    tokenizer = models.load_tokenizer(cfg.model_name)
    tokenized = data.tokenize_dataset(data.load_mrpc(), tokenizer)
    train_config = training.TrainConfig(
        epochs=cfg.epochs, lr=cfg.lr, precision=cfg.precision, seed=cfg.seed, progress=progress
    )
    result: dict[str, Any] = {"config": asdict(cfg), "histories": {}}
    for run in RUNS:
        # Same seed for both: the same classifier-head init, the same batches in the same order.
        seed_everything(cfg.seed)
        model = models.load_model(cfg.model_name, pretrained=run == "pretrained")
        train_dl, val_dl = data.make_dataloaders(
            tokenized,
            tokenizer,
            batch_size=cfg.batch_size,
            precision=cfg.precision,
            seed=cfg.seed,
            train_rows=cfg.train_rows,
            eval_rows=cfg.eval_rows,
        )
        start = time.perf_counter()
        history = training.train(model, train_dl, train_config, eval_dataloader=val_dl)
        final = history.evals[-1]
        result["histories"][run] = history
        result[run] = {
            "accuracy": final["accuracy"],
            "f1": final["f1"],
            "eval_loss": final["loss"],
            "losses": list(history.losses),
            "evals": list(history.evals),
            "seconds": time.perf_counter() - start,
        }
    val_labels = tokenized["validation"]["labels"]
    if cfg.eval_rows is not None:
        val_labels = val_labels[: cfg.eval_rows]
    result["majority_accuracy"] = majority_accuracy(val_labels)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    """The comparison as a markdown table (one row per run, plus the majority-class baseline)."""
    cfg = result["config"]
    rows = [
        "| start from | val accuracy | val F1 | val loss | train seconds |",
        "|---|---|---|---|---|",
    ]
    for run, label in (("pretrained", "pretrained checkpoint"), ("scratch", "random init")):
        r = result[run]
        rows.append(
            f"| {label} | {r['accuracy']:.3f} | {r['f1']:.3f} | {r['eval_loss']:.3f} | {r['seconds']:.0f} |"
        )
    rows.append(f"| (always the majority class) | {result['majority_accuracy']:.3f} | | | |")
    budget = (
        f"{cfg['epochs']} epochs, batch {cfg['batch_size']}, lr {cfg['lr']:g}, precision {cfg['precision']}, "
        f"train rows {cfg['train_rows'] or 'all'}, seed {cfg['seed']}"
    )
    return "\n".join(rows) + f"\n\nSame budget for both: {budget}."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Pretrained checkpoint vs random init, same budget.")
    defaults = ComparisonConfig()
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--precision", default=defaults.precision, help="no (fp32), bf16 or fp16")
    parser.add_argument("--train-rows", type=int, default=None, help="first N training rows (default: all)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--model", default=None, help="hub id or folder (default: COURSE_MODEL / embedded)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    try:
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
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
