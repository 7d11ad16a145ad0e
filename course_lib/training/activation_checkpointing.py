"""[activation_checkpointing] Activation (gradient) checkpointing: keep fewer activations, recompute
them during backward. (Not ``course_lib.checkpoints``, which saves a run to disk.)

Chen et al. (2016): storing only some layers' inputs and recomputing the rest in backward costs about
one extra forward pass (compute x 4/3 when a backward costs two forwards) and cuts activation memory
from O(n) to O(sqrt(n)) for n layers. Hugging Face models checkpoint each transformer layer.

transformers 5 calls it *activation* checkpointing: ``model.activation_checkpointing_enable(...)`` and
``TrainingArguments(activation_checkpointing=True)``; the ``gradient_checkpointing`` names still work
but warn (FutureWarning) that they go in v6.
"""

from __future__ import annotations

import torch


def enable_checkpointing(model: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Turn gradient checkpointing on (or off) for a Hugging Face model; returns the model."""
    supported = getattr(model, "supports_gradient_checkpointing", False)
    if not enabled and not supported:
        return model  # nothing to turn off
    if not supported:
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing: use a Hugging Face model "
            "that does (supports_gradient_checkpointing=True), or wrap its blocks in "
            "torch.utils.checkpoint.checkpoint yourself."
        )
    if enabled:
        # use_reentrant=False: torch's recommended implementation (works with no_sync, and with inputs
        # that do not require grad)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
    return model
