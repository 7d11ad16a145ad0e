"""Data: the MRPC-shaped paraphrase dataset, tokenisation, dynamic padding, length grouping, DataLoaders."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

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


def make_collator(tokenizer, precision: str = "no", pad_to: int | None = None):
    """Dynamic padding to the longest sequence of each batch (a multiple of 8 under fp16/bf16).

    ``pad_to``: pad every batch to exactly this many tokens instead (``padding="max_length"``, as the
    slides' ``tokenizer(..., padding="max_length", max_length=128)`` does): fixed shapes, more padding.
    """
    from transformers import DataCollatorWithPadding

    if pad_to is not None:
        if pad_to < 1:
            raise ValueError(f"pad_to must be a positive number of tokens, got {pad_to}.")
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=pad_to)
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(precision))


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of similar lengths, in a new random order every epoch (less padding per batch).

    The idea of transformers' ``group_by_length`` (``LengthGroupedSampler``): shuffle all rows, cut
    the permutation into mega-batches of ``mega_batches`` x ``batch_size`` rows, sort each mega-batch by
    length and cut it into batches; then shuffle the order of all batches, so that consecutive steps
    do not go from long to short. Every row appears exactly once per epoch. The shuffle is seeded by
    ``seed`` and the epoch: each pass over the sampler is the next epoch (0, 1, ...), and ``set_epoch``
    picks one, as a ``DistributedSampler``'s does.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        seed: int = 0,
        mega_batches: int = 50,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1 or mega_batches < 1:
            raise ValueError(
                f"batch_size and mega_batches must be >= 1, got {batch_size} and {mega_batches}."
            )
        if len(lengths) == 0:
            raise ValueError("No lengths: group a split with at least one row.")
        self.lengths = [int(n) for n in lengths]
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        # At least 4 mega-batches per epoch (as transformers does), so that grouping keeps some randomness.
        self.mega_batches = max(1, min(mega_batches, len(self.lengths) // (4 * batch_size)))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (a distributed training loop calls this every epoch)."""
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        # -(-n // b) is ceil(n / b): the last, smaller batch counts
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int) -> list[list[int]]:
        """The batches (lists of row indices) of ``epoch``: a pure function of seed and epoch."""
        # a prime stride: no two (seed, epoch) pairs share a generator seed while epoch < 100,003
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size = self.mega_batches * self.batch_size
        batches = []
        for start in range(0, len(order), size):
            # longest first, so a mega-batch's one short batch holds its shortest rows
            mega = sorted(order[start : start + size], key=lambda i: self.lengths[i], reverse=True)
            batches += [mega[i : i + self.batch_size] for i in range(0, len(mega), self.batch_size)]
        # Every mega-batch but the last holds mega_batches x batch_size rows, so only the last batch of
        # the last one can be short: it goes last (or is dropped), out of the shuffle.
        full = [b for b in batches if len(b) == self.batch_size]
        tail = [i for b in batches if len(b) < self.batch_size for i in b]
        # the same generator, drawn on: the batch order too is a pure function of (seed, epoch)
        shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        return shuffled + ([tail] if tail and not self.drop_last else [])

    def __iter__(self) -> Iterator[list[int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1  # the next pass is the next epoch
        return iter(self.batches(epoch))


def split_lengths(split) -> list[int]:
    """Token count of every row of a tokenised split (its unpadded ``input_ids``)."""
    return [len(ids) for ids in split["input_ids"]]


def padding_counts(loader: DataLoader) -> dict[str, int]:
    """One pass over ``loader``: ``{"real": tokens that are text, "padded": tokens computed on}``.

    ``padded`` counts every position of every batch (``input_ids.numel()``), ``real`` the unmasked ones.
    """
    real = padded = 0
    for batch in loader:
        real += int(batch["attention_mask"].sum())
        padded += batch["input_ids"].numel()
    return {"real": real, "padded": padded}


def make_dataloader(
    split,
    tokenizer,
    batch_size: int = 32,
    shuffle: bool = False,
    precision: str = "no",
    seed: int = 0,
    num_workers: int = 0,
    pad_to: int | None = None,
    group_by_length: bool = False,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader over a tokenised split with dynamic padding; shuffling is seeded.

    ``pad_to``: pad every batch to this many tokens instead of to its longest row (fixed shapes).
    ``group_by_length``: batches of similar lengths in a seeded random order that changes every epoch
    (``LengthGroupedBatchSampler``; implies shuffling). ``drop_last``: leave out a last, smaller batch.
    """
    if len(split) == 0:
        raise ValueError("Cannot build a DataLoader over an empty split: select at least one row.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    collate_fn = make_collator(tokenizer, precision, pad_to)
    if group_by_length:
        sampler = LengthGroupedBatchSampler(split_lengths(split), batch_size, seed=seed, drop_last=drop_last)
        return DataLoader(split, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers)
    # a generator of its own: the order does not depend on the global RNG's state
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        split,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_fn,
        generator=generator,
        num_workers=num_workers,
        drop_last=drop_last,
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
        # no gradients or optimizer state at evaluation: twice the batch fits
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


class _BatchesOnDevice:
    """A length-grouped DataLoader's batches moved to ``device`` (not a DataLoader: ``accelerator.prepare``
    passes it through unchanged, as it does a ``ShardedLoader``)."""

    def __init__(self, loader: DataLoader, device) -> None:
        self.loader, self.device = loader, torch.device(device)
        self.batch_sampler = loader.batch_sampler  # the loop's set_epoch(epoch) reshuffles through it

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        from course_lib.devices import to_device

        for batch in self.loader:
            yield to_device(batch, self.device)


def make_train_loader(
    split,
    tokenizer,
    batch_size: int,
    precision: str = "no",
    seed: int = 0,
    pad_to: int | None = None,
    pad_multiple: int | None = None,
    group_by_length: bool = False,
    world_size: int = 1,
    rank: int = 0,
    device="cpu",
    drop_last: bool = False,
):
    """The training batches of ``python -m course_lib.cli.train`` and of the recipe ladder (one definition).

    Shuffled by ``seed`` and the epoch. ``pad_to``: every batch padded to that many tokens (the slides'
    ``padding="max_length"``); else dynamic padding to the batch's longest row, rounded up to a multiple
    of ``pad_multiple`` (default: 8 under mixed precision, else none). ``group_by_length``: batches of
    similar lengths (``LengthGroupedBatchSampler``; one process only). Otherwise this rank's shard of a
    ``DistributedSampler`` order (``course_lib.distributed.ShardedLoader``).
    """
    from course_lib.distributed import ShardedLoader

    if pad_multiple is not None and (pad_multiple < 1 or pad_to is not None):
        raise ValueError(
            f"pad_multiple={pad_multiple}: use a positive multiple, and only with dynamic padding (pad_to=None)."
        )
    collate_fn = make_collator(tokenizer, precision, pad_to)
    if pad_to is None and pad_multiple is not None:
        from transformers import DataCollatorWithPadding

        # overrides the precision's default
        collate_fn = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple)
    if not group_by_length:
        return ShardedLoader(
            split,
            batch_size,
            collate_fn,
            world_size,
            rank,
            device,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
        )
    if world_size != 1:
        raise ValueError(
            "Length-grouped batches are built for one process here: leave out --group-by-length under "
            f"{world_size} processes (dynamic padding still applies)."
        )
    sampler = LengthGroupedBatchSampler(split_lengths(split), batch_size, seed=seed, drop_last=drop_last)
    return _BatchesOnDevice(DataLoader(split, batch_sampler=sampler, collate_fn=collate_fn), device)
