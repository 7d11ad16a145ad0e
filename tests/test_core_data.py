"""Behaviours of ``course_lib/data.py`` that mutation testing found unguarded (docs/mutation.md).

One section per area: the embedded dataset and its seed, tokenisation (truncation, the sentence pair,
the columns kept, batched ``map``), the guards and small helpers, the collators (dynamic padding, a
multiple of 8 under mixed precision, fixed ``pad_to``), the DataLoaders (their defaults, seeded order,
``drop_last``, workers), length grouping (``LengthGroupedBatchSampler``: every row once, similar lengths
together, epochs, the exact order of a small case) and the training batches of ``make_train_loader``
(shards, seed, padding switches, length grouping, the device). Everything runs on the embedded
tokenizer and dataset, on the CPU, in a few seconds.
"""

import math
from collections import Counter

import pytest
import torch
from datasets import Dataset, DatasetDict
from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from course_lib import corpus, data
from course_lib.models import load_tokenizer, resolve_model_name


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def mrpc():
    return data.load_mrpc("embedded")


@pytest.fixture(scope="module")
def split(mrpc, tokenizer):
    """The first 100 validation rows, tokenised: lengths 29 to 58 tokens."""
    return data.tokenize_dataset(mrpc["validation"].select(range(100)), tokenizer)


def _ids(split) -> list[tuple[int, ...]]:
    """Each row's (unpadded) token ids, in the split's order."""
    return [tuple(ids.tolist()) for ids in split["input_ids"]]


def _batch_rows(batches) -> list[list[tuple[int, ...]]]:
    """Each batch's rows as their unpadded token ids (padding is where the attention mask is 0)."""
    return [
        [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(b["input_ids"], b["attention_mask"])]
        for b in batches
    ]


def _rows(batches) -> list[tuple[int, ...]]:
    return [row for batch in _batch_rows(batches) for row in batch]


def _widths(batches) -> list[tuple[int, int]]:
    """(padded width, longest row) of every batch."""
    return [(b["input_ids"].shape[1], int(b["attention_mask"].sum(1).max())) for b in batches]


# ----------------------------------------------------------------------------------------------
# The embedded dataset


def test_the_embedded_dataset_is_generated_from_the_seed_asked_for():
    default = data.load_mrpc("embedded")
    assert default["validation"]["sentence1"] == corpus.generate_split("validation", 0)["sentence1"]
    three = data.load_mrpc("embedded", seed=3)
    assert three["validation"]["sentence1"] == corpus.generate_split("validation", 3)["sentence1"]
    assert three["train"]["label"] == corpus.generate_split("train", 3)["label"]
    assert three["validation"]["sentence1"] != default["validation"]["sentence1"]


# ----------------------------------------------------------------------------------------------
# Tokenisation


def _pairs(*pairs: tuple[str, str]) -> Dataset:
    return Dataset.from_dict(
        {
            "sentence1": [a for a, _ in pairs],
            "sentence2": [b for _, b in pairs],
            "label": [i % 2 for i in range(len(pairs))],
            "idx": list(range(len(pairs))),
        }
    )


@pytest.fixture(scope="module")
def long_and_short(mrpc):
    """A pair far over 128 tokens and an ordinary MRPC pair."""
    row = mrpc["train"][0]
    long = " ".join([row["sentence1"]] * 12)
    return _pairs((long, long), (row["sentence1"], row["sentence2"]))


def test_tokenising_encodes_both_sentences_of_each_pair(long_and_short, tokenizer):
    short = long_and_short[1]
    tokenized = data.tokenize_dataset(long_and_short, tokenizer)
    expected = tokenizer(short["sentence1"], short["sentence2"])["input_ids"]
    assert tokenized[1]["input_ids"].tolist() == expected
    assert expected.count(tokenizer.sep_token_id) == 2  # [CLS] first [SEP] second [SEP]
    assert [int(y) for y in tokenized["labels"]] == [0, 1]


def test_tokenising_truncates_to_128_tokens_by_default_and_to_max_length_when_asked(
    long_and_short, tokenizer
):
    assert data.split_lengths(data.tokenize_dataset(long_and_short, tokenizer))[0] == 128
    short = len(tokenizer(long_and_short[1]["sentence1"], long_and_short[1]["sentence2"])["input_ids"])
    assert short > 16
    assert data.split_lengths(data.tokenize_dataset(long_and_short, tokenizer, max_length=16)) == [16, 16]
    assert data.split_lengths(data.tokenize_dataset(long_and_short, tokenizer, max_length=200))[0] == 200


def test_tokenised_rows_hold_only_the_model_inputs_and_labels_even_from_a_bert_tokenizer(long_and_short):
    """A BERT tokenizer also returns ``token_type_ids``, which DistilBERT's forward does not take."""
    from transformers import BertTokenizer

    bert = BertTokenizer.from_pretrained(resolve_model_name("embedded"))
    assert "token_type_ids" in bert("a", "b")
    row = data.tokenize_dataset(long_and_short, bert)[1]
    assert set(row) == {"input_ids", "attention_mask", "labels"}
    assert all(isinstance(v, torch.Tensor) for v in row.values())


@pytest.mark.parametrize("bars_on", [True, False])
def test_tokenising_leaves_the_progress_bar_switch_as_it_found_it(long_and_short, tokenizer, bars_on):
    was_disabled = are_progress_bars_disabled()
    try:
        enable_progress_bars() if bars_on else disable_progress_bars()
        data.tokenize_dataset(long_and_short, tokenizer)
        assert are_progress_bars_disabled() is not bars_on
    finally:
        disable_progress_bars() if was_disabled else enable_progress_bars()


class _CountingTokenizer:
    """The embedded tokenizer, counting its calls (the speed of batched tokenisation, without a timer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)


def test_tokenising_encodes_many_rows_per_tokenizer_call(mrpc, tokenizer):
    """Batched ``map``: the fast tokenizer gets up to 1000 rows a call, not one row a call.

    A spy, because the difference is speed only (the tokens are the same): no timing assertion."""
    counting = _CountingTokenizer(tokenizer)
    tokenized = data.tokenize_dataset(mrpc["validation"], counting)
    assert len(tokenized) == 408 and counting.calls == 1


# ----------------------------------------------------------------------------------------------
# Guards and small helpers


def test_an_empty_split_of_a_dataset_dict_is_named_in_the_error(mrpc, tokenizer):
    rows = mrpc["validation"].select(range(4))
    both = DatasetDict({"train": rows, "validation": rows.select([])})
    with pytest.raises(ValueError, match="Split 'validation' is empty"):
        data.tokenize_dataset(both, tokenizer)
    with pytest.raises(ValueError, match="Split 'dataset' is empty"):
        data.tokenize_dataset(rows.select([]), tokenizer)


@pytest.mark.parametrize("rows, expected", [(None, 100), (1, 1), (5, 5), (100, 100), (10_000, 100)])
def test_first_rows_takes_the_first_rows_and_at_most_all_of_them(split, rows, expected):
    first = data.first_rows(split, rows)
    assert _ids(first) == _ids(split)[:expected]


@pytest.mark.parametrize("rows", [0, -3])
def test_first_rows_refuses_a_count_under_one(split, rows):
    with pytest.raises(ValueError, match=f"Asked for {rows} rows"):
        data.first_rows(split, rows)


@pytest.mark.parametrize("labels, share", [([1], 1.0), ([0], 0.0), ([0, 1, 1, 1], 0.75), ([], 0.0)])
def test_label_balance_is_the_share_of_positive_labels(labels, share):
    assert data.label_balance(labels) == share


def test_split_lengths_are_the_token_counts_of_the_rows(split):
    assert data.split_lengths(split) == [len(ids) for ids in _ids(split)]


def test_padding_counts_counts_text_tokens_and_every_padded_position(split, tokenizer):
    lengths = data.split_lengths(split)
    counts = data.padding_counts(data.make_dataloader(split, tokenizer, 16))
    chunks = [lengths[i : i + 16] for i in range(0, 100, 16)]
    assert counts == {"real": sum(lengths), "padded": sum(len(c) * max(c) for c in chunks)}
    assert counts["padded"] > counts["real"]


# ----------------------------------------------------------------------------------------------
# Collators


def _features(split, rows) -> list[dict]:
    return [{"input_ids": split[i]["input_ids"].tolist()} for i in rows]


def test_the_collator_pads_to_the_longest_row_by_default(split, tokenizer):
    features = _features(split, range(8))
    longest = max(len(f["input_ids"]) for f in features)
    assert longest % 8 != 0
    assert data.make_collator(tokenizer)(features)["input_ids"].shape == (8, longest)


def test_pad_to_pads_every_batch_to_exactly_that_many_tokens(split, tokenizer):
    features = _features(split, range(3))
    batch = data.make_collator(tokenizer, pad_to=64)(features)
    assert batch["input_ids"].shape == (3, 64)
    for row, feature in zip(range(3), features):
        n = len(feature["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == feature["input_ids"]
        assert set(batch["input_ids"][row, n:].tolist()) == {tokenizer.pad_token_id}
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (64 - n)


def test_pad_to_takes_one_token_and_refuses_less(tokenizer):
    one = data.make_collator(tokenizer, pad_to=1)([{"input_ids": [7]}, {"input_ids": [8]}])
    assert one["input_ids"].tolist() == [[7], [8]]
    with pytest.raises(ValueError, match="positive number of tokens, got 0"):
        data.make_collator(tokenizer, pad_to=0)


# ----------------------------------------------------------------------------------------------
# DataLoaders


def test_a_dataloader_by_default_reads_every_row_in_order_32_at_a_time_in_this_process(split, tokenizer):
    loader = data.make_dataloader(split, tokenizer)
    batches = list(loader)
    assert [len(b["labels"]) for b in batches] == [32, 32, 32, 4]  # the last, smaller batch is kept
    assert _rows(batches) == _ids(split)  # neither shuffled nor grouped by length
    assert all(width == longest for width, longest in _widths(batches))  # fp32: no multiple of 8
    assert loader.num_workers == 0  # no worker processes


def test_a_shuffled_dataloader_is_seeded_with_0_by_default(split, tokenizer):
    default = _rows(data.make_dataloader(split, tokenizer, 8, shuffle=True))
    assert default == _rows(data.make_dataloader(split, tokenizer, 8, shuffle=True, seed=0))
    assert default != _rows(data.make_dataloader(split, tokenizer, 8, shuffle=True, seed=1))
    assert sorted(default) == sorted(_ids(split)) and default != _ids(split)


def test_a_dataloader_takes_batches_of_one_and_refuses_zero(split, tokenizer):
    assert [len(b["labels"]) for b in data.make_dataloader(split.select(range(3)), tokenizer, 1)] == [1] * 3
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        data.make_dataloader(split, tokenizer, 0)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_a_dataloader_drops_the_last_smaller_batch_when_asked(split, tokenizer, group_by_length):
    ten = split.select(range(10))
    kept = list(data.make_dataloader(ten, tokenizer, 4, group_by_length=group_by_length))
    dropped = data.make_dataloader(ten, tokenizer, 4, group_by_length=group_by_length, drop_last=True)
    assert sorted(len(b["labels"]) for b in kept) == [2, 4, 4]
    assert len(dropped) == 2 and [len(b["labels"]) for b in dropped] == [4, 4]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_a_dataloader_pads_to_pad_to_and_uses_the_workers_asked_for(split, tokenizer, group_by_length):
    loader = data.make_dataloader(split, tokenizer, 16, pad_to=64, group_by_length=group_by_length)
    assert {b["input_ids"].shape[1] for b in loader} == {64}
    workers = data.make_dataloader(split, tokenizer, 16, num_workers=1, group_by_length=group_by_length)
    assert workers.num_workers == 1  # not iterated: no worker process is started


def test_a_length_grouped_dataloader_reads_its_sampler_s_batches(split, tokenizer):
    loader = data.make_dataloader(split, tokenizer, 8, group_by_length=True, seed=3, drop_last=True)
    sampler = data.LengthGroupedBatchSampler(data.split_lengths(split), 8, seed=3, drop_last=True)
    ids = _ids(split)
    expected = [[ids[i] for i in batch] for batch in sampler.batches(0)]
    assert _batch_rows(loader) == expected
    assert len(expected) == 12 and all(len(b) == 8 for b in expected)
    assert expected != [[ids[i] for i in batch] for batch in sampler.batches(1)]


@pytest.fixture(scope="module")
def splits(mrpc, tokenizer):
    """Train (120 rows) and validation (100 rows), tokenised."""
    return {
        "train": data.tokenize_dataset(mrpc["train"].select(range(120)), tokenizer),
        "validation": data.tokenize_dataset(mrpc["validation"].select(range(100)), tokenizer),
    }


def test_train_and_validation_loaders_by_default(splits, tokenizer):
    train, val = data.make_dataloaders(splits, tokenizer)
    train_batches, val_batches = list(train), list(val)
    assert [len(b["labels"]) for b in train_batches] == [32, 32, 32, 24]
    assert [len(b["labels"]) for b in val_batches] == [64, 36]  # twice the batch: no gradients to keep
    # the training rows shuffled with seed 0, the validation rows in order
    expected = data.make_dataloader(splits["train"], tokenizer, 32, shuffle=True, seed=0)
    assert _rows(train_batches) == _rows(expected) != _ids(splits["train"])
    assert _rows(val_batches) == _ids(splits["validation"])
    assert all(width == longest for width, longest in _widths(train_batches + val_batches))


def test_train_and_validation_loaders_take_rows_batch_sizes_seed_and_precision(splits, tokenizer):
    train, val = data.make_dataloaders(
        splits, tokenizer, 8, eval_batch_size=5, precision="bf16", seed=4, train_rows=50, eval_rows=70
    )
    first50 = splits["train"].select(range(50))
    assert _rows(train) == _rows(data.make_dataloader(first50, tokenizer, 8, shuffle=True, seed=4))
    assert _rows(train) != _rows(data.make_dataloader(first50, tokenizer, 8, shuffle=True, seed=0))
    assert [len(b["labels"]) for b in train] == [8] * 6 + [2]
    assert _rows(val) == _ids(splits["validation"])[:70]
    assert [len(b["labels"]) for b in val] == [5] * 14
    for width, longest in _widths(list(train) + list(val)):
        assert width == 8 * math.ceil(longest / 8)


def test_the_validation_batch_is_twice_the_training_batch_unless_given(splits, tokenizer):
    _, val = data.make_dataloaders(splits, tokenizer, 10)
    assert [len(b["labels"]) for b in val] == [20] * 5
    _, val = data.make_dataloaders(splits, tokenizer, 10, eval_batch_size=25)
    assert [len(b["labels"]) for b in val] == [25] * 4


# ----------------------------------------------------------------------------------------------
# LengthGroupedBatchSampler

NINETEEN = [(7 * i) % 19 + 1 for i in range(19)]  # 19 distinct lengths 1..19


def test_the_sampler_s_exact_batches_for_a_small_case():
    """Pins the order: a pure function of (seed, epoch), which a resumed run and the recorded runs rely on.

    19 rows in batches of 2: 2 mega-batches of 2 batches (4 rows) each, so 4 full mega-batches and a last
    one of 3 rows, whose shortest row is the last, smaller batch."""
    seed0 = data.LengthGroupedBatchSampler(NINETEEN, 2)
    assert seed0.batches(0) == [
        [7, 12],
        [5, 2],
        [8, 1],
        [14, 3],
        [10, 15],
        [11, 0],
        [9, 17],
        [16, 4],
        [13, 18],
        [6],
    ]
    assert seed0.batches(1) == [
        [13, 2],
        [3, 0],
        [6, 11],
        [5, 15],
        [7, 17],
        [8, 10],
        [18, 12],
        [4, 9],
        [16, 1],
        [14],
    ]
    seed1 = data.LengthGroupedBatchSampler(NINETEEN, 2, seed=1)
    assert seed1.batches(0) == [
        [15, 4],
        [13, 9],
        [1, 17],
        [10, 18],
        [7, 0],
        [2, 3],
        [8, 5],
        [16, 12],
        [6, 14],
        [11],
    ]
    assert seed1.batches(1) == [
        [8, 2],
        [16, 5],
        [10, 18],
        [12, 6],
        [14, 0],
        [13, 1],
        [15, 4],
        [17, 11],
        [7, 3],
        [9],
    ]
    dropped = data.LengthGroupedBatchSampler(NINETEEN, 2, seed=1, drop_last=True)
    assert dropped.batches(0) == seed1.batches(0)[:-1]


def test_the_sampler_s_defaults_are_seed_0_fifty_mega_batches_and_no_drop():
    lengths = [(31 * i) % 97 + 1 for i in range(300)]  # 300 rows of 1: up to 75 mega-batches
    default = data.LengthGroupedBatchSampler(lengths, 1)
    explicit = data.LengthGroupedBatchSampler(lengths, 1, seed=0, mega_batches=50, drop_last=False)
    assert default.mega_batches == 50
    assert default.batches(0) == explicit.batches(0)
    assert default.batches(0) != data.LengthGroupedBatchSampler(lengths, 1, mega_batches=51).batches(0)
    assert data.LengthGroupedBatchSampler(NINETEEN, 4).batches(0) == data.LengthGroupedBatchSampler(
        NINETEEN, 4, seed=0, drop_last=False
    ).batches(0)


@pytest.mark.parametrize(
    "rows, batch, asked, used",
    [
        (400, 4, 50, 25),  # at least 4 mega-batches: 400 // (4 * 4)
        (400, 4, 10, 10),  # fewer asked for
        (10_000, 4, 50, 50),  # capped at the number asked for
        (300, 1, 50, 50),
        (31, 4, 50, 1),  # under 4 x 4 x 2 rows: one batch per mega-batch
        (10, 2, 50, 1),
        (3, 4, 50, 1),
    ],
)
def test_the_mega_batch_count_keeps_at_least_four_mega_batches(rows, batch, asked, used):
    sampler = data.LengthGroupedBatchSampler([5] * rows, batch, mega_batches=asked)
    assert sampler.mega_batches == used
    assert sorted(i for b in sampler.batches(0) for i in b) == list(range(rows))


@pytest.mark.parametrize(
    "rows, batch, drop_last, sizes",
    [
        (103, 4, False, [4] * 25 + [3]),
        (103, 4, True, [4] * 25),
        (100, 4, False, [4] * 25),
        (100, 4, True, [4] * 25),
        (19, 2, False, [2] * 9 + [1]),
        (3, 4, False, [3]),
        (3, 4, True, []),
        (1, 1, False, [1]),
    ],
)
def test_every_row_once_per_epoch_with_the_smaller_batch_last_or_dropped(rows, batch, drop_last, sizes):
    lengths = [(37 * i) % 90 + 10 for i in range(rows)]
    sampler = data.LengthGroupedBatchSampler(lengths, batch, seed=2, mega_batches=2, drop_last=drop_last)
    assert len(sampler) == len(sizes)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert [len(b) for b in batches] == sizes
        seen = Counter(i for b in batches for i in b)
        assert set(seen.values()) <= {1}
        assert len(seen) == (rows - rows % batch if drop_last else rows)


def test_the_sampler_groups_similar_lengths_and_each_batch_runs_longest_first():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(400)]
    sampler = data.LengthGroupedBatchSampler(lengths, 4)
    batches = sampler.batches(0)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded(batches) < 0.75 * padded([list(range(i, i + 4)) for i in range(0, 400, 4)])
    assert all([lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True) for b in batches)
    maxima = [max(lengths[i] for i in b) for b in batches]
    assert maxima != sorted(maxima, reverse=True) and maxima != sorted(maxima)  # the batch order is shuffled


def test_the_sampler_s_order_does_not_depend_on_the_global_random_state():
    sampler = data.LengthGroupedBatchSampler(NINETEEN, 2, seed=5)
    torch.manual_seed(1)
    first = sampler.batches(2)
    torch.manual_seed(2)
    assert sampler.batches(2) == first


def test_each_pass_is_the_next_epoch_and_set_epoch_picks_one():
    sampler = data.LengthGroupedBatchSampler(NINETEEN, 2, seed=1)
    assert [list(sampler) for _ in range(3)] == [sampler.batches(e) for e in range(3)]
    sampler.set_epoch(7)
    assert list(sampler) == sampler.batches(7)
    assert list(sampler) == sampler.batches(8)
    assert len({str(sampler.batches(e)) for e in range(9)}) == 9


@pytest.mark.parametrize(
    "rows, batch, drop_last, length", [(10, 4, False, 3), (10, 4, True, 2), (8, 4, True, 2)]
)
def test_the_sampler_s_length_counts_the_batches_of_an_epoch(rows, batch, drop_last, length):
    sampler = data.LengthGroupedBatchSampler(list(range(1, rows + 1)), batch, drop_last=drop_last)
    assert len(sampler) == length == len(sampler.batches(0))


@pytest.mark.parametrize("batch, mega", [(0, 50), (4, 0), (-1, -1)])
def test_the_sampler_refuses_batches_or_mega_batches_under_one(batch, mega):
    with pytest.raises(ValueError, match=f"must be >= 1, got {batch} and {mega}"):
        data.LengthGroupedBatchSampler([3, 4], batch, mega_batches=mega)


def test_the_sampler_takes_one_row_batches_of_one_and_one_mega_batch_and_refuses_no_rows():
    assert data.LengthGroupedBatchSampler([3], 1, mega_batches=1).batches(0) == [[0]]
    with pytest.raises(ValueError, match="at least one row"):
        data.LengthGroupedBatchSampler([], 4)


# ----------------------------------------------------------------------------------------------
# make_train_loader: the training batches of the CLI and of the recipe ladder


def test_the_training_batches_by_default_are_one_shuffled_process_in_fp32_on_the_cpu(split, tokenizer):
    ten = split.select(range(10))
    default = list(data.make_train_loader(ten, tokenizer, 4))
    explicit = data.make_train_loader(
        ten, tokenizer, 4, "no", seed=0, group_by_length=False, world_size=1, rank=0, device="cpu"
    )
    assert _batch_rows(default) == _batch_rows(explicit)
    assert [len(b["labels"]) for b in default] == [4, 4, 2]  # every row, the smaller batch kept
    assert sorted(_rows(default)) == sorted(_ids(ten)) and _rows(default) != _ids(ten)  # shuffled
    assert all(width == longest for width, longest in _widths(default))
    assert {b["input_ids"].device.type for b in default} == {"cpu"}


def test_the_training_batches_follow_the_seed(split, tokenizer):
    three = _rows(data.make_train_loader(split, tokenizer, 8, seed=3))
    assert three == _rows(data.make_train_loader(split, tokenizer, 8, seed=3))
    assert three != _rows(data.make_train_loader(split, tokenizer, 8, seed=0))


def test_the_training_batches_of_two_processes_are_disjoint_shards(split, tokenizer):
    shards = [_rows(data.make_train_loader(split, tokenizer, 8, world_size=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert sorted(shards[0] + shards[1]) == sorted(_ids(split))


def test_length_grouped_training_batches_drop_the_last_smaller_batch_when_asked(split, tokenizer):
    ten = split.select(range(10))
    kept = data.make_train_loader(ten, tokenizer, 4, group_by_length=True)
    assert sorted(len(b["labels"]) for b in kept) == [2, 4, 4] and len(kept) == 3
    dropped = data.make_train_loader(ten, tokenizer, 4, group_by_length=True, drop_last=True)
    assert [len(b["labels"]) for b in dropped] == [4, 4] and len(dropped) == 2


def test_one_process_s_training_batches_drop_the_last_smaller_batch_when_asked(split, tokenizer):
    loader = data.make_train_loader(split.select(range(10)), tokenizer, 4, drop_last=True)
    assert [len(b["labels"]) for b in loader] == [4, 4]


def test_two_processes_drop_the_uneven_tail_instead_of_repeating_rows_when_asked(split, tokenizer):
    eleven = split.select(range(11))

    def shards(**kwargs):
        return [
            _rows(data.make_train_loader(eleven, tokenizer, 5, world_size=2, rank=r, **kwargs))
            for r in (0, 1)
        ]

    padded = shards()  # 6 rows each: one row read twice, so that both processes step as often
    assert [len(s) for s in padded] == [6, 6] and len(set(padded[0] + padded[1])) == 11
    dropped = shards(drop_last=True)  # 5 rows each, none twice
    assert [len(s) for s in dropped] == [5, 5] and len(set(dropped[0] + dropped[1])) == 10


@pytest.mark.parametrize("group_by_length", [False, True])
def test_the_training_batches_are_moved_to_the_device(split, tokenizer, group_by_length):
    """The ``meta`` device: a device other than the CPU on a CPU-only machine."""
    loader = data.make_train_loader(split, tokenizer, 16, group_by_length=group_by_length, device="meta")
    devices = {v.device.type for b in loader for v in b.values()}
    assert devices == {"meta"}


@pytest.mark.parametrize("group_by_length", [False, True])
@pytest.mark.parametrize(
    "precision, pad_to, pad_multiple, width",
    [
        ("bf16", None, None, lambda n: 8 * math.ceil(n / 8)),  # mixed precision: a multiple of 8
        ("no", None, 5, lambda n: 5 * math.ceil(n / 5)),
        ("bf16", None, 5, lambda n: 5 * math.ceil(n / 5)),  # pad_multiple overrides the precision's 8
        ("no", None, 1, lambda n: n),
        ("bf16", 64, None, lambda n: 64),
        ("no", 64, None, lambda n: 64),
    ],
)
def test_the_training_batches_pad_as_asked(
    split, tokenizer, group_by_length, precision, pad_to, pad_multiple, width
):
    loader = data.make_train_loader(
        split,
        tokenizer,
        8,
        precision,
        pad_to=pad_to,
        pad_multiple=pad_multiple,
        group_by_length=group_by_length,
    )
    widths = _widths(loader)
    assert [w for w, _ in widths] == [width(longest) for _, longest in widths]
    assert len({w for w, _ in widths}) > 1 or pad_to  # the rule shows on several widths


@pytest.mark.parametrize("pad_to, pad_multiple", [(None, 0), (None, -8), (64, 4), (64, 1)])
def test_pad_multiple_must_be_positive_and_only_with_dynamic_padding(split, tokenizer, pad_to, pad_multiple):
    with pytest.raises(ValueError, match=f"pad_multiple={pad_multiple}: use a positive multiple"):
        data.make_train_loader(split, tokenizer, 8, pad_to=pad_to, pad_multiple=pad_multiple)


def test_length_grouped_training_batches_are_the_sampler_s_epoch_after_epoch(split, tokenizer):
    loader = data.make_train_loader(split, tokenizer, 8, seed=2, group_by_length=True)
    sampler = data.LengthGroupedBatchSampler(data.split_lengths(split), 8, seed=2)
    ids = _ids(split)

    def rows_of(epoch):
        return [[ids[i] for i in batch] for batch in sampler.batches(epoch)]

    assert len(loader) == len(sampler) == 13
    assert _batch_rows(loader) == rows_of(0)
    assert _batch_rows(loader) == rows_of(1)  # each pass the next epoch
    loader.batch_sampler.set_epoch(5)  # as the training loop does
    assert _batch_rows(loader) == rows_of(5)


def test_length_grouped_training_batches_refuse_several_processes(split, tokenizer):
    with pytest.raises(ValueError, match="under 2 processes"):
        data.make_train_loader(split, tokenizer, 8, group_by_length=True, world_size=2, rank=0)
