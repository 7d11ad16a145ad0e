"""[local_sgd] Local SGD: each process takes ``local_sgd_steps`` optimizer steps on its own, then the
processes average their parameters (one all-reduce of the parameters instead of one of the gradients
per step).

Lin et al. (2018) and DiLoCo (Douillard et al. 2023) show that a model trained this way reaches about
the same quality with far less communication (DiLoCo: 500x less). The loop uses Accelerate's
``LocalSGD``: inside it, DDP never all-reduces gradients (``no_sync``); ``step()`` averages the
parameters every ``local_sgd_steps`` optimizer steps, and leaving the block averages them once more.
Optimizer state is not averaged: each process keeps its own (checkpoints save every rank's).
In one process there is nothing to average, and the block does nothing, as Accelerate's does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager


class _NoAveraging(AbstractContextManager):
    """Stands in for ``LocalSGD`` when local SGD is off (or there is one process): does nothing."""

    num_steps = 0

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        return None


def local_sgd(backend, model, local_sgd_steps: int | None, start_step: int = 0):
    """A context manager with ``step()``: Accelerate's ``LocalSGD`` when ``local_sgd_steps`` is set and
    the loop runs on an ``Accelerator`` (``backend.accelerator``), else a no-op.

    ``start_step`` continues the averaging schedule of a resumed run (resume at a multiple of
    ``local_sgd_steps``, where every process holds the same averaged parameters).
    """
    if local_sgd_steps is not None and local_sgd_steps < 1:
        raise ValueError(f"local_sgd_steps must be >= 1 (or None for off), got {local_sgd_steps}.")
    accelerator = getattr(backend, "accelerator", None)
    if not local_sgd_steps or accelerator is None:
        return _NoAveraging()
    from accelerate.local_sgd import LocalSGD

    averager = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps, enabled=True)
    averager.num_steps = start_step  # LocalSGD averages when num_steps % local_sgd_steps == 0
    return averager
