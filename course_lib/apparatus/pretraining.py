"""Lesson 01's demonstration: what the pretrained checkpoint knows, against random init of the same shape.

- ``masked_token_accuracy`` / ``fill_mask_examples``: the pretraining task itself (masked-LM) on
  sentence pairs the checkpoint never saw. ``swap_fact`` changes the fact in sentence 1 to test
  whether a guess is read from the other sentence or comes from the model's prior alone.
- ``pretrained_vs_scratch``: fine-tune both on the paraphrase task with the same data, budget and
  seed, next to ``majority_accuracy`` (the bar a classifier must clear). The embedded checkpoint
  was pretrained to compare the facts of two sentences (``course_tools.build_assets``), so on
  a short CPU budget it clears the bar while random init stays at it.

``python -m course_tools.experiments`` runs both and writes README's "pretrained" block.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from course_lib import data, models, training
from course_lib.corpus import pretraining_pairs
from course_lib.devices import seed_everything
from course_lib.mixed_precision import normalize_precision

RUNS = ("pretrained", "scratch")
MASK_SHARE = 0.15  # share of the non-special tokens masked by masked_token_accuracy

# One fact masked in the second sentence; the same fact stands in the first one, so a model that
# compares the two sentences can copy it across [SEP]. (sentence1, sentence2, answer: a word of both)
FILL_MASK_EXAMPLES: list[tuple[str, str, str]] = [
    (
        "Initech said on Monday that its quarterly profit rose 12 percent to $45 million.",
        "Quarterly profit at Initech rose 12 percent to $45 million, the company said on Monday.",
        "Initech",
    ),
    (
        "Police in Denver arrested 40 protesters on Friday after a protest near the stadium.",
        "On Friday, 40 protesters were detained by Denver police following a protest near the stadium.",
        "Denver",
    ),
    (
        "Globex said it would cut nearly 3200 jobs in Osaka by July.",
        "By July, Globex plans to cut about 3200 jobs at its Osaka site.",
        "July",
    ),
]


@dataclass
class ComparisonConfig:
    """Budget of the pretrained-vs-scratch comparison (the same for both runs)."""

    epochs: int = 2
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


def pretraining_recipe() -> dict[str, Any]:
    """The recipe the embedded checkpoint was built with (``pretraining.json`` beside its weights)."""
    return json.loads((models.EMBEDDED_MODEL_DIR / "pretraining.json").read_text(encoding="utf-8"))["recipe"]


def heldout_pretraining_pairs(n: int = 200) -> list[tuple[str, str]]:
    """The first ``n`` of the pretraining pairs that ``build_assets`` held out (never trained on).

    ``build_assets`` draws ``corpus_pairs + heldout_pairs`` pairs from ``pretraining_pairs`` with
    its seed, trains on the first ``corpus_pairs`` and measures on the rest: these are the rest.
    """
    cfg = pretraining_recipe()
    train, heldout = cfg["corpus_pairs"], cfg["heldout_pairs"]
    if not 1 <= n <= heldout:
        raise ValueError(f"n must be between 1 and {heldout} (the held-out pairs), got {n}.")
    corpus = list(pretraining_pairs(train + heldout, seed=cfg["seed"]))
    return corpus[train : train + n]


def load_masked_lm(model_name: str | None = None, pretrained: bool = True, seed: int = 0):
    """``AutoModelForMaskedLM`` in eval mode: the checkpoint's weights, or random init (seeded)."""
    from transformers import AutoConfig, AutoModelForMaskedLM
    from transformers.utils import logging as hf_logging

    resolved = models.resolve_model_name(model_name)
    if not pretrained:
        torch.manual_seed(seed)  # the random init is reproducible
        return AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(resolved)).eval()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bar: noise on stderr for a 1 s load
    try:
        # transformers 5 defaults to the checkpoint's dtype
        return AutoModelForMaskedLM.from_pretrained(resolved, dtype=torch.float32).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def mask_tokens(input_ids: torch.Tensor, candidates: torch.Tensor, mask_id: int, seed: int = 0):
    """Replace a seeded ``MASK_SHARE`` of the ``candidates`` positions by ``mask_id``.

    ``input_ids`` and ``candidates`` (bool) are ``(batch, seq)``; returns ``(masked_ids, where)``,
    both ``(batch, seq)``, ``where`` a bool tensor of the masked positions.
    """
    gen = torch.Generator().manual_seed(seed)
    # a draw per position: the same positions for every model
    where = (torch.rand(input_ids.shape, generator=gen) < MASK_SHARE) & candidates
    return input_ids.masked_fill(where, mask_id), where


@torch.no_grad()
def masked_token_accuracy(
    pretrained: bool = True, model_name: str | None = None, pairs: int = 200, seed: int = 0
) -> float:
    """Share of masked tokens the masked-LM predicts exactly (top-1) on held-out pretraining pairs.

    ``MASK_SHARE`` of the non-special tokens of ``[CLS] a [SEP] b [SEP]`` become ``[MASK]``; the
    positions depend only on ``seed``, so the pretrained and the random-init model see the same ones.
    """
    tokenizer = models.load_tokenizer(model_name)
    model = load_masked_lm(model_name, pretrained=pretrained, seed=seed)
    first, second = zip(*heldout_pretraining_pairs(pairs))
    enc = tokenizer(
        list(first),
        list(second),
        truncation=True,
        max_length=pretraining_recipe()["max_length"],
        padding=True,
        return_special_tokens_mask=True,
        return_tensors="pt",
    )
    candidates = (enc["special_tokens_mask"] == 0) & (enc["attention_mask"] == 1)
    masked_ids, where = mask_tokens(enc["input_ids"], candidates, tokenizer.mask_token_id, seed)
    logits = model(input_ids=masked_ids, attention_mask=enc["attention_mask"]).logits  # (batch, seq, vocab)
    correct = logits.argmax(-1)[where] == enc["input_ids"][where]
    return correct.float().mean().item()


def compare_masked_lm(model_name: str | None = None, pairs: int = 200, seed: int = 0) -> dict[str, float]:
    """``{"pretrained", "scratch", "chance", "pairs"}``: masked-token accuracies and 1 / vocabulary size."""
    vocab = len(models.load_tokenizer(model_name))
    return {run: masked_token_accuracy(run == "pretrained", model_name, pairs, seed) for run in RUNS} | {
        "chance": 1.0 / vocab,
        "pairs": pairs,
    }


@torch.no_grad()
def fill_mask_examples(
    examples: list[tuple[str, str, str]] | None = None, model_name: str | None = None, seed: int = 0
) -> list[dict[str, str]]:
    """Mask ``answer`` in sentence 2 of each pair and decode the top-1 guess of both models.

    Returns one ``{"sentence1", "sentence2" (masked), "answer", "pretrained", "scratch"}`` per
    example. A word the tokenizer splits into several tokens is masked as several ``[MASK]``.
    """
    examples = FILL_MASK_EXAMPLES if examples is None else examples
    tokenizer = models.load_tokenizer(model_name)
    rows = []
    for sentence1, sentence2, answer in examples:
        if answer not in sentence2:
            raise ValueError(f"answer {answer!r} does not occur in sentence 2: {sentence2!r}.")
        n_tokens = len(tokenizer.tokenize(answer))
        masked = sentence2.replace(answer, " ".join([tokenizer.mask_token] * n_tokens), 1)
        rows.append({"sentence1": sentence1, "sentence2": masked, "answer": answer})
    for run in RUNS:
        model = load_masked_lm(model_name, pretrained=run == "pretrained", seed=seed)
        for row in rows:
            enc = tokenizer(row["sentence1"], row["sentence2"], return_tensors="pt")
            where = enc["input_ids"][0] == tokenizer.mask_token_id
            guess = model(**enc).logits[0, where].argmax(-1)  # (tokens of the answer,)
            row[run] = tokenizer.decode(guess)
    return rows


def swap_fact(example: tuple[str, str, str], alternatives: list[str]) -> list[tuple[str, str, str]]:
    """The ``example`` once per alternative, its answer replaced by that alternative in both sentences.

    Fed to ``fill_mask_examples``, this tests whether a guess comes from sentence 1 (it follows the
    alternative) or only from the model's prior over the slot (it stays the same).
    """
    sentence1, sentence2, answer = example
    if answer not in sentence1 or answer not in sentence2:
        raise ValueError(f"answer {answer!r} must occur in both sentences of {example!r}.")
    return [(sentence1.replace(answer, alt), sentence2.replace(answer, alt), alt) for alt in alternatives]


# The tables' words: English for the README (``course_tools.experiments``), Japanese for lesson 01.
TABLE_WORDS = {
    "en": {
        "weights": "weights",
        "mlm": "masked-token accuracy",
        "pretrained": "pretrained checkpoint",
        "scratch": "random init",
        "chance": "(chance: 1 / vocabulary size)",
        "mlm_note": "Held-out pretraining pairs: {pairs}, {share:.0%} of the non-special tokens replaced by "
        "[MASK], top-1 prediction must equal the original token.",
        "header": "| start from | val accuracy | val F1 | val loss | train seconds |",
        "majority": "(always the majority class)",
        "budget": "Same budget for both: {epochs} epochs, batch {batch_size}, lr {lr:g}, precision {precision}, "
        "train rows {rows}, seed {seed}.",
        "rows": "{n}",
        "all": "all",
    },
    "ja": {
        "weights": "重み",
        "mlm": "隠したトークンの正解率",
        "pretrained": "事前学習済みのチェックポイント",
        "scratch": "ランダムな初期値",
        "chance": "（でたらめに選んだ場合: 1 / 語彙サイズ）",
        "mlm_note": "事前学習に使わなかった文ペア {pairs} 組で、特殊トークン以外の {share:.0%} を [MASK] に置き換え、"
        "1 番目の候補が元のトークンと一致した割合です。",
        "header": "| 開始点 | 検証の正解率 | 検証の F1 | 検証の損失 | 学習の秒数 |",
        "majority": "（常に多数派のラベルを答える）",
        "budget": "どちらも同じ予算です: {epochs} エポック、バッチ {batch_size}、学習率 {lr:g}、混合精度 {precision}、"
        "訓練データ {rows}、シード {seed}。",
        "rows": "{n} 行",
        "all": "全行",
    },
}


def _words(lang: str) -> dict[str, str]:
    if lang not in TABLE_WORDS:
        raise ValueError(f"Unknown lang {lang!r}: use one of {', '.join(TABLE_WORDS)}.")
    return TABLE_WORDS[lang]


def masked_lm_table(mlm: dict[str, float], lang: str = "en") -> str:
    """The masked-LM comparison as a markdown table (one row per start, plus chance); ``lang``: "en" or "ja"."""
    w = _words(lang)
    rows = [f"| {w['weights']} | {w['mlm']} |", "|---|---|"]
    rows.append(f"| {w['pretrained']} | {mlm['pretrained']:.3f} |")
    rows.append(f"| {w['scratch']} | {mlm['scratch']:.3f} |")
    rows.append(f"| {w['chance']} | {mlm['chance']:.3f} |")
    return "\n".join(rows) + "\n\n" + w["mlm_note"].format(pairs=mlm["pairs"], share=MASK_SHARE)


def pretrained_vs_scratch(
    epochs: int = 2,
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
        val_labels = val_labels[: cfg.eval_rows]  # the rows data.first_rows evaluated on
    result["majority_accuracy"] = majority_accuracy(val_labels)
    return result


def fine_tuning_table(result: dict[str, Any], lang: str = "en") -> str:
    """The fine-tuning table: a row per start, and the majority class; ``lang``: "en" or "ja"."""
    w = _words(lang)
    cfg = result["config"]
    rows = [w["header"], "|---|---|---|---|---|"]
    for run in RUNS:
        r = result[run]
        rows.append(
            f"| {w[run]} | {r['accuracy']:.3f} | {r['f1']:.3f} | {r['eval_loss']:.3f} | {r['seconds']:.0f} |"
        )
    rows.append(f"| {w['majority']} | {result['majority_accuracy']:.3f} | | | |")
    budget = w["budget"].format(
        epochs=cfg["epochs"],
        batch_size=cfg["batch_size"],
        lr=cfg["lr"],
        precision=cfg["precision"],
        rows=w["rows"].format(n=cfg["train_rows"]) if cfg["train_rows"] else w["all"],
        seed=cfg["seed"],
    )
    return "\n".join(rows) + "\n\n" + budget
