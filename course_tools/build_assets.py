"""Rebuild the embedded pretrained checkpoint: ``python -m course_tools.build_assets``.

Steps (all offline, deterministic for a given torch build and thread count):
1. Train a lower-cased WordPiece vocabulary on the course's own pretraining corpus: unlabelled
   pairs of sentences that state the same fact in different words (``corpus.pretraining_pairs``).
2. Pretrain a small DistilBERT (same architecture family as ``distilbert-base-uncased``, scaled down)
   on those pairs, ``[CLS] a [SEP] b [SEP]``, with two self-supervised objectives, as BERT was:
   - masked-LM (``PairMaskingCollator``): besides the usual 15 % of tokens, facts (names, places,
     days, numbers, ...) of one sentence that also stand in the other are masked or swapped for
     another fact of the same kind, and the model must restore them. That is only possible by
     reading the other sentence, so the model learns to find the same fact across ``[SEP]``.
   - a pair task on ``[CLS]`` (BERT's next-sentence prediction, ``PairTask``): is the second
     sentence the partner of the first, or a sentence about another event (mostly of the same
     kind, so only the facts differ)? Its small head is thrown away; what stays is a ``[CLS]``
     that summarises whether the two sentences agree.
   No label of the paraphrase dataset is used: pairs and partners come from their own stream.
3. Save config, ``model.safetensors`` and tokenizer files in Hugging Face format, plus
   ``pretraining.json`` with the recipe and the measured held-out accuracies.

Reproducibility: the same torch build and thread count give the same weights for the same
vocabulary, but the ``tokenizers`` WordPiece trainer breaks ties between equally frequent pieces in
an arbitrary order, so a rebuild may number (and, rarely, split) a few pieces differently. The
measured accuracies in ``pretraining.json`` and the lessons' comparisons are what a rebuild must
reproduce, not the bytes.

The result lives in ``course_lib/assets/tiny-distilbert`` and is committed, so learners never
need to run this (about 17 minutes on two idle CPU cores).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from course_lib import corpus
from course_lib.models import EMBEDDED_MODEL_DIR


@dataclass
class PretrainConfig:
    """The recipe of the embedded checkpoint (written next to it as ``pretraining.json``)."""

    vocab_size: int = 1200
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    hidden_dim: int = 512
    max_position_embeddings: int = 128
    corpus_pairs: int = 40_000
    heldout_pairs: int = 1_000
    max_length: int = 96
    batch_size: int = 64
    steps: int = 6_000
    lr: float = 1e-3
    warmup_steps: int = 200
    mlm_probability: float = 0.15  # any non-special token (80 % [MASK], 10 % random, 10 % kept)
    fact_probability: float = 0.8  # a fact that both sentences state (40 % [MASK], 40 % swapped, 20 % kept)
    partner_share: float = 0.5  # pair task: share of true partners
    same_kind_share: float = 0.8  # of the other partners: share about another event of the same kind
    pair_task_weight: float = 1.0
    seed: int = 0


def train_tokenizer(sentences: list[str], vocab_size: int):
    """A lower-cased WordPiece ``DistilBertTokenizer`` trained on ``sentences``."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import DistilBertTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(sentences, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return DistilBertTokenizer(vocab=wp.get_vocab(), do_lower_case=True, model_max_length=128)


def fact_kinds(tokenizer) -> dict[int, int]:
    """Token id -> kind of fact (company, person, city, day, ..., direction word, number).

    Kinds come from the corpus's slot pools; a token shared by two kinds (a common word) has none.
    """
    pools = [
        corpus.COMPANIES,
        corpus.PEOPLE,
        corpus.CITIES,
        corpus.DAYS,
        corpus.MONTHS,
        corpus.PERIODS,
        corpus.ROLES,
        corpus.ORGS,
        corpus.FACILITIES,
        corpus.PRODUCTS,
        corpus.CROWDS,
        corpus.SYN["rose"] + corpus.SYN["fell"],
        corpus.SYN["approved"] + corpus.SYN["rejected"],
        corpus.SYN["launch"] + corpus.SYN["delay"],
    ]
    owners: dict[int, set[int]] = {}
    for kind, pool in enumerate(pools):
        for value in pool:
            for token in tokenizer(value, add_special_tokens=False)["input_ids"]:
                owners.setdefault(token, set()).add(kind)
    for text, token in tokenizer.get_vocab().items():
        if re.fullmatch(r"(##)?\d+", text):
            owners.setdefault(token, set()).add(len(pools))  # numbers
    return {token: next(iter(kinds)) for token, kinds in owners.items() if len(kinds) == 1}


class PairMaskingCollator:
    """Masked-LM batches from ``[CLS] a [SEP] b [SEP]`` ids, with facts masked across the pair.

    In one sentence of each pair (chosen at random), a token that is a fact and also stands in the
    other sentence is selected with ``fact_probability``: 40 % become ``[MASK]``, 40 % another fact
    of the same kind (a plausible but wrong value), 20 % stay. Every other non-special token is
    selected with ``mlm_probability`` (80 % ``[MASK]``, 10 % a random token, 10 % kept), as in BERT.
    Labels are the original ids at selected positions and -100 elsewhere. Seeded: the same seed
    gives the same batches.
    """

    def __init__(self, tokenizer, mlm_probability: float, fact_probability: float, seed: int = 0):
        self.tokenizer = tokenizer
        self.kinds = fact_kinds(tokenizer)
        self.members: dict[int, list[int]] = {}
        for token, kind in sorted(self.kinds.items()):
            self.members.setdefault(kind, []).append(token)
        self.mlm_probability, self.fact_probability = mlm_probability, fact_probability
        self.special = set(tokenizer.all_special_ids)
        self.rng = random.Random(seed)

    def corrupt(self, ids: list[int]) -> tuple[list[int], list[int]]:
        rng, mask_id = self.rng, self.tokenizer.mask_token_id
        sep = ids.index(self.tokenizer.sep_token_id)
        first, second = range(1, sep), range(sep + 1, len(ids) - 1)
        target, other = (second, first) if rng.random() < 0.5 else (first, second)
        other_tokens = {ids[j] for j in other}
        out, labels = list(ids), [-100] * len(ids)
        for j, token in enumerate(ids):
            if token in self.special:
                continue
            kind = self.kinds.get(token)
            fact = j in target and kind is not None and token in other_tokens and len(self.members[kind]) > 1
            if fact and rng.random() < self.fact_probability:
                labels[j] = token
                roll = rng.random()
                if roll < 0.4:
                    out[j] = mask_id
                elif roll < 0.8:
                    while out[j] == token:
                        out[j] = rng.choice(self.members[kind])
            elif not fact and rng.random() < self.mlm_probability:
                labels[j] = token
                roll = rng.random()
                if roll < 0.8:
                    out[j] = mask_id
                elif roll < 0.9:
                    out[j] = rng.randrange(len(self.tokenizer))
        return out, labels

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [self.corrupt(list(f["input_ids"])) for f in features]
        width = -(-max(len(ids) for ids, _ in rows) // 8) * 8  # pad to a multiple of 8
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, labs) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(ids)] = torch.tensor(labs)
            attention_mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PairTask:
    """BERT's next-sentence task on the course's pairs: the true partner (1), or not (0).

    A non-partner is the second sentence of another pair, with ``same_kind_share`` of them about
    another event of the same kind (the same frame), so that only the facts tell them apart.
    """

    def __init__(self, triples: list[tuple[str, str, int]], cfg: PretrainConfig, seed: int = 0):
        if len(triples) < 2:
            raise ValueError(
                f"The pair task needs at least 2 pairs to draw non-partners from, got {len(triples)}."
            )
        self.triples, self.cfg = triples, cfg
        self.by_frame: dict[int, list[int]] = {}
        for i, (_, _, frame) in enumerate(triples):
            self.by_frame.setdefault(frame, []).append(i)
        self.rng = random.Random(seed)

    def example(self, i: int) -> tuple[str, str, int]:
        first, second, frame = self.triples[i]
        if self.rng.random() < self.cfg.partner_share:
            return first, second, 1
        j = i
        while j == i:
            # A frame with one pair has no other event of its kind: draw from all pairs instead.
            same_kind = self.rng.random() < self.cfg.same_kind_share and len(self.by_frame[frame]) > 1
            j = self.rng.choice(self.by_frame[frame]) if same_kind else self.rng.randrange(len(self.triples))
        return first, self.triples[j][1], 0

    def batch(self, size: int) -> list[tuple[str, str, int]]:
        return [self.example(self.rng.randrange(len(self.triples))) for _ in range(size)]


def build(out_dir: Path, cfg: PretrainConfig, log_every: int = 100) -> dict:
    """Train tokenizer and model per ``cfg``; save both to ``out_dir``; return the report."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(cfg.seed)
    triples = list(corpus.pretraining_triples(cfg.corpus_pairs + cfg.heldout_pairs, seed=cfg.seed))
    train_triples, heldout_triples = triples[: cfg.corpus_pairs], triples[cfg.corpus_pairs :]
    tokenizer = train_tokenizer([s for a, b, _ in train_triples for s in (a, b)], cfg.vocab_size)

    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        hidden_dim=cfg.hidden_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DistilBertForMaskedLM(config)
    # The pair task's head reads [CLS]; it is not saved (fine-tuning brings its own head).
    pair_head = torch.nn.Sequential(
        torch.nn.Linear(cfg.dim, cfg.dim), torch.nn.Tanh(), torch.nn.Linear(cfg.dim, 2)
    )
    collator = PairMaskingCollator(tokenizer, cfg.mlm_probability, cfg.fact_probability, seed=cfg.seed)
    pair_task = PairTask(train_triples, cfg, seed=cfg.seed)

    def forward(examples: list[tuple[str, str, int]]):
        enc = tokenizer(
            [e[0] for e in examples], [e[1] for e in examples], truncation=True, max_length=cfg.max_length
        )
        batch = collator([{"input_ids": ids} for ids in enc["input_ids"]])
        out = model(**batch, output_hidden_states=True)
        pair_logits = pair_head(out.hidden_states[-1][:, 0])  # (batch, 2) from [CLS]
        return batch, out, pair_logits, torch.tensor([e[2] for e in examples])

    params = list(model.parameters()) + list(pair_head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        _, out, pair_logits, pair_labels = forward(pair_task.batch(cfg.batch_size))
        pair_loss = torch.nn.functional.cross_entropy(pair_logits, pair_labels)
        loss = out.loss + cfg.pair_task_weight * pair_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == cfg.steps - 1:
            print(
                f"step {step:5d}  mlm loss {out.loss.item():.3f}  pair loss {pair_loss.item():.3f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
    seconds = time.perf_counter() - start

    # Held-out pairs (never trained on): masked-token accuracy and pair-task accuracy.
    model.eval()
    heldout_task = PairTask(heldout_triples, cfg, seed=cfg.seed + 1)
    masked = masked_correct = pairs_correct = 0
    with torch.no_grad():
        for i in range(0, len(heldout_triples), 250):
            examples = [heldout_task.example(j) for j in range(i, min(i + 250, len(heldout_triples)))]
            batch, out, pair_logits, pair_labels = forward(examples)
            where = batch["labels"] != -100
            masked_correct += (out.logits.argmax(-1)[where] == batch["labels"][where]).sum().item()
            masked += where.sum().item()
            pairs_correct += (pair_logits.argmax(-1) == pair_labels).sum().item()

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    report = {
        "recipe": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_mlm_loss": round(out.loss.item(), 4),
        "heldout_masked_token_accuracy": round(masked_correct / masked, 4),
        "heldout_pair_task_accuracy": round(pairs_correct / len(heldout_triples), 4),
        "train_seconds": round(seconds, 1),
        "built_with": {"torch": torch.__version__, "python": platform.python_version()},
    }
    (out_dir / "pretraining.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=EMBEDDED_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=PretrainConfig.batch_size)
    args = parser.parse_args(argv)
    report = build(args.out, PretrainConfig(steps=args.steps, batch_size=args.batch_size))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
