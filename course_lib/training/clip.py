"""[clip] Gradient clipping to a maximum global norm, on the true (unscaled) gradients."""

from __future__ import annotations

import torch


def clip_gradients(steps, model: torch.nn.Module, optimizer, max_norm: float) -> torch.Tensor:
    """Unscale first (fp16's scaled gradients would shift the threshold by the scale), then clip."""
    steps.unscale(optimizer)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
