"""Data: the MRPC-shaped paraphrase dataset, tokenisation, dynamic padding and DataLoaders."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import DataLoader

from course_lib.config import EMBEDDED, HUB_DATASET, sources
from course_lib.corpus import SPLIT_SIZES, generate_split
from course_lib.mixed_precision import normalize_precision

LABEL_NAMES = ["not_equivalent", "equivalent"]


def load_mrpc(source: str | None = None, seed: int = 0):
    """MRPC as a ``DatasetDict`` (train / validation / test; sentence1, sentence2, label, idx).

    ``source``: ``"embedded"`` (default; generated offline, deterministic) or ``"hub"``
    (``nyu-mll/glue`` / ``mrpc``, needs internet once). ``None`` reads ``COURSE_DATASET``.
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    source = sources().dataset if source is None else source
    if source == "hub":
        from datasets import load_dataset

        try:
            return load_dataset(*HUB_DATASET)
        except Exception as err:  # offline, blocked, or not cached
            raise ConnectionError(
                f"Could not load {'/'.join(HUB_DATASET)} from the Hugging Face Hub ({err}). "
                "Offline, use the embedded dataset: COURSE_DATASET=embedded (the default)."
            ) from err
    if source != EMBEDDED:
        raise ValueError(f"Unknown dataset source {source!r}: use 'embedded' or 'hub'.")
    features = Features(
        {
            "sentence1": Value("string"),
            "sentence2": Value("string"),
            "label": ClassLabel(names=LABEL_NAMES),
            "idx": Value("int32"),
        }
    )
    return DatasetDict(
        {name: Dataset.from_dict(generate_split(name, seed), features=features) for name in SPLIT_SIZES}
    )


def tokenize_dataset(dataset, tokenizer, max_length: int = 128):
    """Tokenise sentence pairs with ``Dataset.map`` (no padding: the collator pads per batch).

    Returns columns ``input_ids``, ``attention_mask``, ``labels`` (torch format).
    """
    _check_not_empty(dataset)

    def encode(batch):
        return tokenizer(batch["sentence1"], batch["sentence2"], truncation=True, max_length=max_length)

    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    remove = [c for c in dataset_column_names(dataset) if c != "label"]
    bars = not are_progress_bars_disabled()
    disable_progress_bars()  # under a second: a bar would only add stderr noise
    try:
        tokenized = dataset.map(encode, batched=True, remove_columns=remove)
    finally:
        if bars:
            enable_progress_bars()
    tokenized = tokenized.rename_column("label", "labels")
    keep = ["input_ids", "attention_mask", "labels"]
    tokenized.set_format("torch", columns=keep)
    return tokenized


def dataset_column_names(dataset) -> list[str]:
    """Column names of a ``Dataset`` or of the first split of a ``DatasetDict``."""
    names = dataset.column_names
    return next(iter(names.values())) if isinstance(names, dict) else names


def _check_not_empty(dataset) -> None:
    splits = dataset.items() if hasattr(dataset, "items") else [("dataset", dataset)]
    for name, split in splits:
        if len(split) == 0:
            raise ValueError(
                f"Split {name!r} is empty: nothing to tokenise or train on. Check the filter or "
                "`select` that produced it, or load the data again with load_mrpc()."
            )


def pad_multiple(precision: str) -> int | None:
    """Pad to a multiple of 8 under mixed precision (tensor-core friendly shapes), else not at all."""
    return 8 if normalize_precision(precision) != "no" else None


def make_collator(tokenizer, precision: str = "no"):
    """Dynamic padding to the longest sequence of each batch (a multiple of 8 under fp16/bf16)."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(precision))


def make_dataloader(
    split,
    tokenizer,
    batch_size: int = 32,
    shuffle: bool = False,
    precision: str = "no",
    seed: int = 0,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader over a tokenised split with dynamic padding; shuffling is seeded."""
    if len(split) == 0:
        raise ValueError("Cannot build a DataLoader over an empty split: select at least one row.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        split,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=make_collator(tokenizer, precision),
        generator=generator,
        num_workers=num_workers,
    )


def make_dataloaders(
    tokenized,
    tokenizer,
    batch_size: int = 32,
    eval_batch_size: int | None = None,
    precision: str = "no",
    seed: int = 0,
    train_rows: int | None = None,
    eval_rows: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Train (shuffled) and validation DataLoaders, optionally over the first N rows of each."""
    train = first_rows(tokenized["train"], train_rows)
    val = first_rows(tokenized["validation"], eval_rows)
    return (
        make_dataloader(train, tokenizer, batch_size, shuffle=True, precision=precision, seed=seed),
        make_dataloader(val, tokenizer, eval_batch_size or 2 * batch_size, precision=precision),
    )


def first_rows(split, rows: int | None):
    """The first ``rows`` rows of ``split`` (all of them for ``None``, at most its length)."""
    if rows is None:
        return split
    if rows < 1:
        raise ValueError(f"Asked for {rows} rows: pass a positive number, or None for all rows.")
    return split.select(range(min(rows, len(split))))


def label_balance(labels: Iterable[int]) -> float:
    """Share of positive labels."""
    labels = list(labels)
    return sum(labels) / max(1, len(labels))
