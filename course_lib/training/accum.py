"""[accum] Gradient accumulation: one optimizer step over ``k`` micro-batches.

Each micro-batch's loss is divided by ``k`` before backward, so the summed gradients are the mean
over the ``k`` micro-batches: the step equals one on a ``k``-times bigger batch (for equal-sized
micro-batches). The last window of an epoch may be shorter: it still ends in a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any


def micro_batches(dataloader, k: int, start: int = 0) -> Iterator[tuple[Any, bool]]:
    """``(batch, update)`` from batch ``start`` on; ``update`` on every ``k``-th and on the last batch."""
    n = len(dataloader)
    batches: Iterable = islice(enumerate(dataloader), start, None)
    for i, batch in batches:
        yield batch, (i + 1) % k == 0 or i + 1 == n


def steps_per_epoch(batches: int, k: int) -> int:
    """Optimizer steps in an epoch of ``batches`` micro-batches (a short last window is a step)."""
    return -(-batches // k)
