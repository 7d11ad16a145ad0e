"""Rebuild the embedded pretrained checkpoint: ``python -m course_lib.build_assets``.

Steps (all offline, deterministic for a given torch build and thread count):
1. Train a lower-cased WordPiece vocabulary on the course's own pretraining corpus: unlabelled
   pairs of sentences that state the same fact in different words (``corpus.pretraining_pairs``).
2. Pretrain a small DistilBERT (same architecture family as ``distilbert-base-uncased``, scaled down)
   with masked-language modelling on those pairs, ``[CLS] a [SEP] b [SEP]``. The intent is that the
   model learns to find a masked number or name across the separator; measured, the embedded
   checkpoint does not (it predicts the right *kind* of word, not the fact of the other sentence:
   see ``course_lib.experiments.swap_fact`` and lesson 01).
3. Save config, ``model.safetensors`` and tokenizer files in Hugging Face format, plus
   ``pretraining.json`` with the recipe and the measured held-out masked-token accuracy.

The result lives in ``course_lib/assets/tiny-distilbert`` and is committed, so learners never
need to run this (it takes a few minutes on two CPU cores).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from course_lib.corpus import pretraining_pairs
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
    steps: int = 2_500
    lr: float = 1e-3
    warmup_steps: int = 200
    mlm_probability: float = 0.25
    # Of the selected tokens: 50 % become [MASK], 30 % a random token, 20 % stay. Many visible
    # tokens may be wrong, so every position learns to check itself against the other sentence.
    mask_replace_prob: float = 0.5
    random_replace_prob: float = 0.3
    seed: int = 0


def train_tokenizer(sentences: list[str], vocab_size: int):
    """A lower-cased WordPiece ``DistilBertTokenizer`` trained on ``sentences``."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import DistilBertTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(sentences, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return DistilBertTokenizer(vocab=wp.get_vocab(), do_lower_case=True, model_max_length=128)


def build(out_dir: Path, cfg: PretrainConfig, log_every: int = 100) -> dict:
    """Train tokenizer and masked-LM model per ``cfg``; save both to ``out_dir``; return metrics."""
    from transformers import DataCollatorForLanguageModeling, DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(cfg.seed)
    corpus = list(pretraining_pairs(cfg.corpus_pairs + cfg.heldout_pairs, seed=cfg.seed))
    train_pairs, heldout_pairs = corpus[: cfg.corpus_pairs], corpus[cfg.corpus_pairs :]
    tokenizer = train_tokenizer([s for pair in train_pairs for s in pair], cfg.vocab_size)

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
    collator = DataCollatorForLanguageModeling(
        tokenizer,
        mlm_probability=cfg.mlm_probability,
        mask_replace_prob=cfg.mask_replace_prob,
        random_replace_prob=cfg.random_replace_prob,
        pad_to_multiple_of=8,
    )

    def encode(pairs: list[tuple[str, str]]) -> list[dict]:
        first, second = zip(*pairs)
        enc = tokenizer(list(first), list(second), truncation=True, max_length=cfg.max_length)
        return [{"input_ids": ids} for ids in enc["input_ids"]]

    train_feats, heldout_feats = encode(train_pairs), encode(heldout_pairs)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(train_feats), (cfg.batch_size,), generator=gen).tolist()
        batch = collator([train_feats[i] for i in idx])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == cfg.steps - 1:
            print(f"step {step:5d}  mlm loss {loss.item():.3f}  {time.perf_counter() - start:.0f}s")
    seconds = time.perf_counter() - start

    model.eval()
    correct = total = 0
    with torch.no_grad():
        for i in range(0, len(heldout_feats), 256):
            batch = collator(heldout_feats[i : i + 256])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            mask = batch["labels"] != -100
            correct += (logits.argmax(-1)[mask] == batch["labels"][mask]).sum().item()
            total += mask.sum().item()

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    report = {
        "recipe": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_mlm_loss": round(loss.item(), 4),
        "heldout_masked_token_accuracy": round(correct / total, 4),
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
