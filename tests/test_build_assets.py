"""The recipe of the embedded checkpoint: fact kinds, the pair-masking collator, the pair task."""

import json

import pytest
import torch

from course_lib import corpus, models
from course_tools import build_assets


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer()


@pytest.fixture(scope="module")
def encoded(tokenizer):
    pairs = list(corpus.pretraining_pairs(64, seed=5))
    enc = tokenizer([a for a, _ in pairs], [b for _, b in pairs])
    return [{"input_ids": ids} for ids in enc["input_ids"]]


def test_fact_kinds_group_facts_and_leave_common_words_out(tokenizer):
    kinds = build_assets.fact_kinds(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    assert kinds[ids("monday")] == kinds[ids("friday")] != kinds[ids("boston")]
    assert kinds[ids("12")] == kinds[ids("45")]  # numbers
    assert kinds[ids("rose")] == kinds[ids("fell")]  # a direction can be flipped
    assert ids("the") not in kinds and ids("percent") not in kinds


def test_collator_labels_only_selected_tokens_and_swaps_facts_within_their_kind(tokenizer, encoded):
    collator = build_assets.PairMaskingCollator(tokenizer, mlm_probability=0.15, fact_probability=0.5)
    batch = collator(encoded)
    ids, labels, attention = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == attention.shape and ids.shape[1] % 8 == 0
    assert (labels[attention == 0] == -100).all()
    special = torch.isin(labels, torch.tensor(tokenizer.all_special_ids))
    assert not special.any(), "special tokens are never targets"
    original = torch.where(labels == -100, ids, labels)
    changed = ids != original
    assert (labels[changed] != -100).all(), "every changed token is a target"
    kinds = collator.kinds
    swapped = [
        (int(o), int(n))
        for o, n in zip(original[changed], ids[changed])
        if int(n) != tokenizer.mask_token_id and int(o) in kinds and int(n) in kinds
    ]
    assert swapped and sum(kinds[o] == kinds[n] for o, n in swapped) / len(swapped) > 0.9
    share = (labels != -100).sum() / attention.sum()
    assert 0.1 < share < 0.4, share


def test_collator_is_seeded(tokenizer, encoded):
    def make():
        return build_assets.PairMaskingCollator(tokenizer, 0.15, 0.5, seed=3)(encoded)

    first, second = make(), make()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_pair_task_mixes_partners_and_other_events_of_the_same_kind():
    cfg = build_assets.PretrainConfig()
    triples = list(corpus.pretraining_triples(2000, seed=2))
    task = build_assets.PairTask(triples, cfg, seed=0)
    examples = task.batch(1000)
    partners = {(a, b) for a, b, _ in triples}
    labels = [label for _, _, label in examples]
    assert 0.4 < sum(labels) / len(labels) < 0.6
    assert all(((a, b) in partners) == bool(label) for a, b, label in examples)
    frame_of = {b: frame for _, b, frame in triples}
    frame_of_first = {a: frame for a, _, frame in triples}
    negatives = [(a, b) for a, b, label in examples if not label]
    same = sum(frame_of_first[a] == frame_of[b] for a, b in negatives) / len(negatives)
    assert same > 0.7, same


def test_pair_task_handles_a_lone_frame_and_rejects_too_few_pairs():
    cfg = build_assets.PretrainConfig(same_kind_share=1.0, partner_share=0.0)
    task = build_assets.PairTask([("a", "b", 0), ("c", "d", 1)], cfg)  # each frame has one pair
    assert task.batch(4) and all(label == 0 for _, _, label in task.batch(4))
    with pytest.raises(ValueError, match="at least 2 pairs"):
        build_assets.PairTask([("a", "b", 0)], cfg)


def test_pretraining_triples_are_the_pairs_with_their_frame():
    triples = list(corpus.pretraining_triples(50, seed=4))
    assert [(a, b) for a, b, _ in triples] == list(corpus.pretraining_pairs(50, seed=4))
    assert {frame for _, _, frame in triples} <= set(range(len(corpus.FRAMES)))


def test_build_writes_a_loadable_checkpoint_and_its_report(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = build_assets.PretrainConfig(
        corpus_pairs=400, heldout_pairs=50, steps=3, batch_size=8, warmup_steps=1
    )
    report = build_assets.build(tmp_path, cfg, log_every=1000)
    assert report["recipe"]["steps"] == 3
    correct = report["heldout_pair_task_accuracy"] * cfg.heldout_pairs  # scored on the 50 held-out pairs
    assert correct == pytest.approx(round(correct), abs=1e-2) and 0 <= correct <= cfg.heldout_pairs
    assert json.loads((tmp_path / "pretraining.json").read_text()) == report
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    logits = model(**tokenizer("a b", "c d", return_tensors="pt")).logits
    assert logits.shape == (1, 2)


def test_the_committed_recipe_is_the_builders_default():
    """Lesson 01's demo reads the recipe from the checkpoint's pretraining.json, the builder from
    ``PretrainConfig``: the two must agree, or the held-out pairs the demo uses were trained on."""
    from dataclasses import asdict

    from course_lib.apparatus.pretraining import pretraining_recipe

    assert pretraining_recipe() == asdict(build_assets.PretrainConfig())
