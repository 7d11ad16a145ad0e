"""[clip] Gradient clipping to a maximum global norm, on the true (unscaled) gradients."""

from __future__ import annotations

import torch


def clip_gradients(backend, model: torch.nn.Module, optimizer, max_norm: float) -> float:
    """Unscale first (fp16's scaled gradients would shift the threshold by the scale), then clip;
    return the gradients' global norm before clipping."""
    backend.unscale(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # FSDP: the norm of sharded gradients is a DTensor; full_tensor() is the norm over all ranks' shards
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
