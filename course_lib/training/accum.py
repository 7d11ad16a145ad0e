"""[accum] Gradient accumulation: one optimizer step over ``k`` micro-batches.

The step equals one on a ``k``-times bigger batch (for equal-sized micro-batches). Accelerate's
``accumulate`` divides a short last window's losses by ``k``, which shrinks that step's gradient;
Trainer divides by the window's length only when ``model_accepts_loss_kwargs`` is False, and not at
all for a model whose forward takes ``**kwargs``. Lesson 04 measures both, and the finer point:
micro-batches of different sizes need weights by rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any


def micro_batches(dataloader, k: int, start: int = 0) -> Iterator[tuple[Any, bool, int]]:
    """``(batch, update, window)`` from batch ``start`` on.

    ``update`` on every ``k``-th and on the last batch; ``window``: how many micro-batches the batch's
    window holds (``k``, fewer in the epoch's short last window).
    """
    n = len(dataloader)
    # islice loads and drops the skipped batches (a cost), so the rest come in the uninterrupted order
    batches: Iterable = islice(enumerate(dataloader), start, None)
    for i, batch in batches:
        # update: every k-th batch and the epoch's last, so a short last window still ends in a step.
        # window: the batches in i's window, k or the n - (window start) left; the loop divides each
        # loss by it, so the summed gradients are the window's mean (dividing by k would shrink them)
        yield batch, (i + 1) % k == 0 or i + 1 == n, min(k, n - i // k * k)


def steps_per_epoch(batches: int, k: int) -> int:
    """Optimizer steps in an epoch of ``batches`` micro-batches (a short last window is a step)."""
    return -(-batches // k)  # ceil(batches / k) in integers


def run_steps(batches: int, k: int, epochs: int, max_steps: int | None) -> int:
    """Optimizer steps of a whole run: ``max_steps``, else ``epochs`` epochs of ``batches`` micro-batches
    (this process's share of them). The one count the loop and the training command both use."""
    return max_steps or steps_per_epoch(batches, k) * epochs
