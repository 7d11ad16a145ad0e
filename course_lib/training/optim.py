"""The optimizer and learning-rate schedule every course run uses: AdamW, linear warm-up and decay."""

from __future__ import annotations

import torch


def fused_adamw_supported(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch has a fused AdamW kernel for all of ``params`` (floating point, on such a device)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a private helper: fall back to the devices known to have the kernel
        devices = {"cpu", "cuda"}
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and LayerNorm weights.

    ``fused=None`` (default) uses torch's fused AdamW kernel where there is one, as Trainer's default
    ``adamw_torch_fused`` does: one kernel for all parameters instead of a loop with temporaries
    (docs/benchmark.md measures the difference). The update is the same AdamW.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    if fused is None:
        fused = fused_adamw_supported(decay + no_decay)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def make_scheduler(optimizer, total_steps: int, warmup_ratio: float, start_step: int = 0):
    """Linear warm-up, then linear decay to zero; ``start_step`` continues a resumed run's schedule."""
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        step += start_step
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
