"""The ladder's two measurements of a stack, through the course loop (``training.train``).

* ``throughput_run``: examples per second over the same training rows for every stack (``timed_rows``),
  batched the stack's own way; the ladder interleaves them in rounds (``ladder_runs``).
* ``accuracy_run``: the validation accuracy after every ``eval_every`` batches of training examples,
  for one seed; the examples seen when it first reaches the target are its examples to target.

``prepare`` tokenises the data and loads the model once; every run trains a copy.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from course_lib import data
from course_lib.devices import seed_everything
from course_lib.distributed import disable_dropout
from course_lib.recipe_ladder.rungs import Stack, train_settings
from course_lib.training import train
from course_lib.training.metrics import evaluate

EVAL_BATCH = 64  # rows per evaluation batch (sorted by length: each batch pads to little more than its rows)


@dataclass
class Prepared:
    """What every run shares: model to copy, tokenizer, train rows, evaluation loader, ``timed_rows``."""

    model: torch.nn.Module
    tokenizer: Any
    train: Any
    eval_loader: Any
    timed: Any  # the rows every throughput run times (``timed_rows``)


def timed_rows(train_rows, cfg):
    """``cfg.timed_steps`` x ``cfg.batch_size`` random rows (``cfg.seed``; whole largest batches): every stack's."""
    # [same rows] an epoch's first batches are other rows under length grouping or a larger batch, and
    # their token counts differ by as much as the gains decided on: time every stack on these rows
    whole = cfg.batch_size * (cfg.large_batch if "large_batch" in cfg.rungs else 1)
    n = min(len(train_rows), -(-cfg.timed_steps * cfg.batch_size // whole) * whole)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(cfg.seed))
    return train_rows.select(sorted(order[:n].tolist()))


def prepare(cfg) -> Prepared:
    """Tokenise the embedded data and load the model (seeded head) once: what every run copies.

    The training rows are rounded down to whole batches of the largest batch a run uses, so every
    run sees the same examples per epoch.
    """
    from course_lib.models import load_model, load_tokenizer

    tokenizer = load_tokenizer()
    tokenized = data.tokenize_dataset(data.load_mrpc(), tokenizer, cfg.max_length)
    whole = cfg.batch_size * (cfg.large_batch if "large_batch" in cfg.rungs else 1)
    train_rows = data.first_rows(tokenized["train"], cfg.train_rows)
    rows = len(train_rows) // whole * whole
    if rows == 0:
        raise ValueError(
            f"{len(train_rows)} training rows make no batch of {whole}: use more rows or a smaller batch."
        )
    evals = data.first_rows(tokenized["validation"], cfg.eval_rows)
    lengths = data.split_lengths(evals)
    # [sorted evaluation] rows of similar lengths in each evaluation batch: less padding, the same
    # predictions (masked padding), so the frequent evaluations cost less
    evals = evals.select(sorted(range(len(evals)), key=lengths.__getitem__))
    seed_everything(cfg.seed)
    model = load_model()
    model.config.problem_type = "single_label_classification"  # what the first forward pass would set
    eval_loader = data.make_dataloader(evals, tokenizer, EVAL_BATCH)
    # Its own generator: an evaluation mid-run then draws no number from the global RNG (dropout's).
    eval_loader.generator = torch.Generator().manual_seed(cfg.seed)
    train = train_rows.select(range(rows))
    return Prepared(model, tokenizer, train, eval_loader, timed_rows(train, cfg))


def _loader(stack: Stack, prepared: Prepared, cfg, seed: int, device: torch.device):
    _, settings = train_settings(stack, cfg, seed)
    return data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)


def timed_loader(stack: Stack, prepared: Prepared, cfg, device: torch.device):
    """The timed rows in ``stack``'s batches, one pass shuffled by ``cfg.seed`` (a fresh loader: the same)."""
    _, settings = train_settings(stack, cfg, cfg.seed)
    loader = data.make_train_loader(prepared.timed, prepared.tokenizer, device=device, **settings)
    if stack.group_by_length:  # the split's rule (>= 4 mega-batches) would give so few rows 1-batch ones
        loader.batch_sampler.mega_batches = len(loader)  # a few batches: sorted as one mega-batch
    return loader


class _WarmUpThenTimed:
    """The warm-up batches, then one pass over the timed rows' batches: one epoch of the course loop."""

    def __init__(self, warm_up: list, timed) -> None:
        self.warm_up, self.timed = warm_up, timed

    def __len__(self) -> int:
        return len(self.warm_up) + len(self.timed)

    def __iter__(self):
        yield from self.warm_up
        yield from self.timed


def accuracy_run(
    stack: Stack, prepared: Prepared, cfg, seed: int, device: torch.device, stop_at: int | None = None
) -> dict[str, Any]:
    """Train ``stack`` with ``seed`` for the budget; evaluate every ``cfg.eval_every`` base batches.

    Returns ``evals`` (examples seen, correct validation rows, accuracy) and the final correct count.
    ``stop_at``: end the run (through ``on_step``) at the first evaluation with at least that many
    correct rows. Runs with dynamic padding and without compilation: the same function (tested).
    """
    stack = replace(stack, dynamic_padding=True, compile=False)
    train_cfg, settings = train_settings(stack, cfg, seed)
    model = copy.deepcopy(prepared.model)
    loader = _loader(stack, prepared, cfg, seed, device)
    every = cfg.eval_every // stack.batch_mult  # eval_every counts base batches; a step holds batch_mult
    steps = cfg.epochs * len(loader)
    evals: list[dict[str, Any]] = []
    n = len(prepared.eval_loader.dataset)

    def on_step(step: int) -> bool:
        if step % every and step != steps:
            return False
        accuracy = evaluate(model, prepared.eval_loader)["accuracy"]  # fp32, the uncompiled module
        correct = round(accuracy * n)  # a count: the target compares rows, not rounded fractions
        evals.append({"examples": step * settings["batch_size"], "correct": correct, "accuracy": correct / n})
        return stop_at is not None and correct >= stop_at

    history = train(model, loader, train_cfg, on_step=on_step)
    return {"seed": seed, "evals": evals, "final_correct": evals[-1]["correct"], "losses": history.losses}


def examples_to(evals: list[dict[str, Any]], target_correct: int) -> int | None:
    """Training examples seen at the first evaluation with at least ``target_correct`` (None: never)."""
    return next((e["examples"] for e in evals if e["correct"] >= target_correct), None)


def throughput_run(
    stack: Stack, prepared: Prepared, cfg, device: torch.device, fresh_compile: bool = False
) -> dict[str, Any]:
    """Examples (and tokens) per second over the timed rows, after ``cfg.warmup_steps`` untimed steps.

    ``fresh_compile``: compile from an empty cache and report ``compile_s``, the warm-up steps' time
    beyond that of as many timed steps.
    """
    warm = list(itertools.islice(_loader(stack, prepared, cfg, cfg.seed, device), cfg.warmup_steps))
    loader = _WarmUpThenTimed(warm, timed_loader(stack, prepared, cfg, device))
    train_cfg, _ = train_settings(stack, cfg, cfg.seed, max_steps=len(loader))
    with _fresh_compile(stack.compile and fresh_compile):
        history = train(copy.deepcopy(prepared.model), loader, train_cfg)
    timed = history.step_times[len(warm) :]
    seconds = sum(timed)
    tokens = data.padding_counts(timed_loader(stack, prepared, cfg, device))
    out = {
        "examples_per_s": len(prepared.timed) / seconds,
        "tokens_per_s": tokens["padded"] / seconds,
        "real_tokens_per_s": tokens["real"] / seconds,
    }
    if stack.compile and fresh_compile:
        warm = history.step_times[: cfg.warmup_steps]
        # the warm-up beyond as many steps at the timed rate; max(0): noise can make that negative
        out["compile_s"] = max(0.0, sum(warm) - len(warm) * seconds / len(timed))
    return out


def _fresh_compile(enabled: bool):
    """An empty dynamo and inductor cache: compilation costs what it costs on a first run."""
    if not enabled:
        return contextlib.nullcontext()
    import torch._dynamo

    torch._dynamo.reset()
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # a private helper: without it a warm on-disk cache may make compiling cheaper
        return contextlib.nullcontext()
    return fresh_cache()


def warm_up(prepared: Prepared, cfg, device: torch.device) -> None:
    """Untimed steps in each padding scheme, attention and AdamW kernel on throwaway copies, and one
    evaluation: first-use costs (allocations, lazy imports) would otherwise land on the first rung."""
    for stack in (Stack(), Stack(dynamic_padding=True, fused_adamw=True, attention="sdpa")):
        train_cfg, settings = train_settings(stack, cfg, cfg.seed, max_steps=2)
        loader = data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)
        train(copy.deepcopy(prepared.model), loader, train_cfg)
    evaluate(copy.deepcopy(prepared.model).to(device), prepared.eval_loader)


def same_function_losses(
    stacks: list[Stack], prepared: Prepared, cfg, device: torch.device, steps: int = 3
) -> list[list[float]]:
    """The training losses of ``steps`` steps of each stack from the same weights, without dropout.

    Dropout draws its masks from tensors of the batch's shape, so with dropout on, another padding
    draws other masks: a different sample of the same random function, not a different function.
    """
    model = disable_dropout(copy.deepcopy(prepared.model))
    out = []
    for stack in stacks:
        train_cfg, settings = train_settings(stack, cfg, cfg.seed, max_steps=steps)
        loader = data.make_train_loader(prepared.train, prepared.tokenizer, device=device, **settings)
        out.append(train(copy.deepcopy(model), loader, train_cfg).losses)
    return out
