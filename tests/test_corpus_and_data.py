import pytest
import torch

from course_lib import corpus, data
from course_lib.models import load_tokenizer


@pytest.fixture(scope="module")
def mrpc():
    return data.load_mrpc("embedded")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def test_embedded_dataset_has_mrpc_shape(mrpc):
    assert set(mrpc) == {"train", "validation", "test"}
    assert {name: len(split) for name, split in mrpc.items()} == corpus.SPLIT_SIZES
    assert mrpc["train"].column_names == ["sentence1", "sentence2", "label", "idx"]
    assert mrpc["train"].features["label"].names == ["not_equivalent", "equivalent"]
    assert mrpc["validation"]["idx"] == list(range(len(mrpc["validation"])))


def test_embedded_dataset_is_deterministic_and_splits_differ():
    a, b = corpus.generate_split("train"), corpus.generate_split("train")
    assert a == b
    val = corpus.generate_split("validation")
    assert not set(zip(val["sentence1"], val["sentence2"])) & set(zip(a["sentence1"], a["sentence2"]))


def test_label_balance_is_mrpc_like(mrpc):
    share = data.label_balance(mrpc["train"]["label"])
    assert 0.62 < share < 0.72


def test_word_overlap_does_not_separate_the_classes(mrpc):
    """A bag-of-words baseline must not solve the task (negatives often differ in one word)."""
    split = mrpc["validation"]

    def jaccard(a, b):
        a, b = set(a.lower().split()), set(b.lower().split())
        return len(a & b) / len(a | b)

    scores = [jaccard(a, b) for a, b in zip(split["sentence1"], split["sentence2"])]
    labels = split["label"]
    best = max(
        sum((s >= t) == bool(y) for s, y in zip(scores, labels)) / len(labels) for t in sorted(set(scores))
    )
    assert best < 0.80, f"a word-overlap threshold reaches {best:.2%}: the dataset is too easy"


def test_unknown_split_and_source_are_rejected():
    with pytest.raises(ValueError, match="Unknown split"):
        corpus.generate_split("dev")
    with pytest.raises(ValueError, match="Unknown dataset source"):
        data.load_mrpc("kaggle")


def test_hub_dataset_offline_fails_loudly_with_advice():
    with pytest.raises(ConnectionError, match="COURSE_DATASET=embedded"):
        data.load_mrpc("hub")


def test_env_switch_is_validated(monkeypatch):
    monkeypatch.setenv("COURSE_DATASET", "glue")
    with pytest.raises(ValueError, match="COURSE_DATASET='glue'"):
        data.load_mrpc()


def test_tokenize_and_dynamic_padding(mrpc, tokenizer):
    tokenized = data.tokenize_dataset(mrpc, tokenizer)
    assert tokenized["train"].column_names == ["labels", "input_ids", "attention_mask"]
    row = tokenized["train"][0]
    assert row["input_ids"][0].item() == tokenizer.cls_token_id
    dl = data.make_dataloader(tokenized["train"], tokenizer, batch_size=8, precision="bf16")
    batch = next(iter(dl))
    assert batch["input_ids"].shape[1] % 8 == 0
    assert batch["input_ids"].dtype == torch.long and batch["labels"].shape == (8,)
    dl32 = data.make_dataloader(tokenized["train"], tokenizer, batch_size=8, precision="no")
    b32 = next(iter(dl32))
    assert b32["attention_mask"][:, -1].any(), "fp32 batches pad to the longest row only"


def test_shuffling_is_seeded(mrpc, tokenizer):
    tokenized = data.tokenize_dataset(mrpc["validation"], tokenizer)

    def first_batch(**kwargs):
        return next(iter(data.make_dataloader(tokenized, tokenizer, 4, **kwargs)))["input_ids"]

    seven = first_batch(shuffle=True, seed=7)
    assert torch.equal(seven, first_batch(shuffle=True, seed=7))  # the same seed: the same order
    assert not torch.equal(seven[:, :8], first_batch(shuffle=True, seed=8)[:, :8])  # another seed: another
    assert not torch.equal(seven[:, :8], first_batch(shuffle=False)[:, :8])  # ... and shuffled at all


def test_empty_split_is_a_clear_error(mrpc, tokenizer):
    empty = mrpc["train"].select([])
    with pytest.raises(ValueError, match="empty"):
        data.tokenize_dataset(empty, tokenizer)
    tokenized = data.tokenize_dataset(mrpc["validation"], tokenizer)
    with pytest.raises(ValueError, match="empty split"):
        data.make_dataloader(tokenized.select([]), tokenizer)
    with pytest.raises(ValueError, match="positive"):
        data.make_dataloaders({"train": tokenized, "validation": tokenized}, tokenizer, train_rows=0)
