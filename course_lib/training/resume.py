"""[resume] Continue a checkpointed run from optimizer step ``start_step``.

The caller restores model, optimizer and RNG state (``course_lib.checkpoints``); the loop then skips
the epochs and batches already trained on and continues the learning-rate schedule from there, so a
resumed run ends on the same parameters as an uninterrupted one. ``on_step(step)`` runs after every
optimizer step (the training command saves checkpoints there).
"""

from __future__ import annotations


def resume_position(start_step: int, steps_per_epoch: int, k: int) -> tuple[int, int]:
    """``(epoch, batch)`` where step ``start_step`` begins: the first epoch and the batches to skip."""
    epoch, steps_done = divmod(start_step, steps_per_epoch)
    return epoch, steps_done * k  # each finished step used k batches (a short window ends the epoch)
