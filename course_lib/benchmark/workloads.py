"""The model and data every implementation trains on: a model size, fixed-shape padded batches."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from course_lib import models
from course_lib.benchmark.config import MODEL_SIZES, check_choice
from course_lib.devices import (
    seed_everything,
)


def build_model(size: str, seed: int = 0, seq_len: int = 128) -> torch.nn.Module:
    """The fp32 classifier of ``size``: the embedded checkpoint (tiny) or a seeded random init."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    size = check_choice(size, MODEL_SIZES, "model size", "--sizes")
    seed_everything(seed)  # before from_config: the random init (and the new head) are the seed's
    if MODEL_SIZES[size] is None:
        model = models.load_model("embedded")
    else:
        config = AutoConfig.from_pretrained(str(models.EMBEDDED_MODEL_DIR), num_labels=2, **MODEL_SIZES[size])
        model = AutoModelForSequenceClassification.from_config(config)
    limit = model.config.max_position_embeddings
    if seq_len > limit:
        raise ValueError(
            f"seq_len {seq_len} is longer than the {size} model's {limit} positions: use --seq-len {limit} "
            "or less."
        )
    return model


def count_matmul_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters outside embedding tables (a lookup does no matmul): the N of 6N."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in embedding)


class FixedLengthDataset(Dataset):
    """Sentence pairs padded to one length: every batch is ``(batch_size, seq_len)``."""

    def __init__(self, encodings: dict[str, torch.Tensor], tokenizer=None):
        self.encodings, self.tokenizer = encodings, tokenizer

    def __len__(self) -> int:
        return len(self.encodings["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[i] for key, value in self.encodings.items()}


def fixed_length_dataset(rows: int, seq_len: int = 128, tokenizer=None) -> FixedLengthDataset:
    """The first ``rows`` training pairs of the embedded MRPC data, padded/truncated to ``seq_len``.

    Rows repeat from the start if more are asked for than the split holds.
    """
    from course_lib import data

    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}.")
    tokenizer = tokenizer or models.load_tokenizer("embedded")
    split = data.load_mrpc("embedded")["train"]
    index = [i % len(split) for i in range(rows)]
    picked = split.select(index)
    enc = tokenizer(
        list(picked["sentence1"]),
        list(picked["sentence2"]),
        truncation=True,
        max_length=seq_len,
        padding="max_length",
        return_tensors="pt",
    )
    encodings = {
        "input_ids": enc["input_ids"],  # (rows, seq_len)
        "attention_mask": enc["attention_mask"],  # (rows, seq_len)
        "labels": torch.tensor(list(picked["label"]), dtype=torch.long),  # (rows,)
    }
    return FixedLengthDataset(encodings, tokenizer)
