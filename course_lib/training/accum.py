"""[accum] Gradient accumulation: one optimizer step over ``k`` micro-batches.

Each micro-batch's loss is divided by the number of micro-batches in its window (``k``) before
backward, so the summed gradients are the mean over the window: the step equals one on a
``k``-times bigger batch (for equal-sized micro-batches). The last window of an epoch may be
shorter: it still ends in a step, and its losses are divided by its own length, not by ``k`` (which
would shrink that step's gradient, as Accelerate's ``accumulate`` does; Trainer divides as here only
when ``model_accepts_loss_kwargs`` is False, and not at all for a model whose forward takes ``**kwargs``).
Lesson 04 measures both, and the finer point: micro-batches of different sizes need weights by rows.
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
    batches: Iterable = islice(enumerate(dataloader), start, None)
    for i, batch in batches:
        yield batch, (i + 1) % k == 0 or i + 1 == n, min(k, n - i // k * k)


def steps_per_epoch(batches: int, k: int) -> int:
    """Optimizer steps in an epoch of ``batches`` micro-batches (a short last window is a step)."""
    return -(-batches // k)
