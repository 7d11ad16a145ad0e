"""[optim] The optimizer and the learning-rate schedule: AdamW (default), Adafactor or 8-bit AdamW.

* ``adamw``      ``torch.optim.AdamW``, fused where torch has the kernel: 8 bytes of state per parameter
* ``adafactor``  ``torch.optim.Adafactor`` (Shazeer & Stern 2018): factored second moments, n + m
  numbers for an n x m matrix, no first moment
* ``adamw8bit``  ``bitsandbytes.optim.AdamW8bit`` (Dettmers et al. 2021): both moments in 8 bits with
  block-wise scales, about 2 bytes per parameter (tensors under 4,096 elements stay 32-bit)

``TRAINER_OPTIM`` gives the ``TrainingArguments(optim=...)`` name of each.
"""

from __future__ import annotations

import logging

import torch

OPTIMIZERS = ("adamw", "adafactor", "adamw8bit")
# On CPUs with AVX512-BF16, bitsandbytes' CPU backend logs a warning at import when it cannot fetch an
# optional 4-bit matmul kernel from the Hub (8-bit optimizers never use it).
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
# The TrainingArguments(optim=...) name of each (Trainer's "adafactor" is transformers' own Adafactor).
TRAINER_OPTIM = {"adamw": "adamw_torch_fused", "adafactor": "adafactor", "adamw8bit": "adamw_bnb_8bit"}


def import_bitsandbytes():
    """Import ``bitsandbytes`` without its import-time warning about the optional 4-bit CPU kernel.

    Only that one logger is raised to ERROR, before the first import; every other message still shows.
    """
    logging.getLogger(_BNB_CPU_LOGGER).setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes


def fused_adamw_supported(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch has a fused AdamW kernel for all of ``params`` (floating point, on such a device)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a private helper: fall back to the devices known to have the kernel
        devices = {"cpu", "cuda"}
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    fused: bool | None = None,
    name: str = "adamw",
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of ``OPTIMIZERS``), with no weight decay on biases and LayerNorm weights.

    ``fused=None`` (default) uses torch's fused AdamW kernel where there is one, as Trainer's default
    ``adamw_torch_fused`` does: one kernel for all parameters instead of a loop with temporaries
    (docs/benchmark.md measures the difference). The update is the same AdamW.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}.")
    decay, no_decay = [], []
    for param_name, p in model.named_parameters():
        if p.requires_grad:
            # ndim < 2: biases and norm weights, whatever the model names them
            no_decay_here = p.ndim < 2 or "LayerNorm" in param_name or "layer_norm" in param_name
            (no_decay if no_decay_here else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adafactor":
        # torch's Adafactor scales its step by the parameter's RMS; lr caps the relative step size.
        return torch.optim.Adafactor(groups, lr=lr)
    if name == "adamw8bit":
        try:
            bnb = import_bitsandbytes()
        except ImportError as err:
            raise ImportError(
                "optimizer 'adamw8bit' needs bitsandbytes: pip install 'bitsandbytes==0.50.2' "
                "(the course's pyproject.toml installs it)."
            ) from err
        return bnb.optim.AdamW8bit(groups, lr=lr)
    if fused is None:
        fused = fused_adamw_supported(decay + no_decay)
    # False -> None: torch's default, foreach on GPUs, the for-loop on CPUs (fused=False: always the loop)
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def make_scheduler(optimizer, total_steps: int, warmup_ratio: float, start_step: int = 0):
    """Linear warm-up, then linear decay to zero; ``start_step`` continues a resumed run's schedule."""
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        step += start_step
        if step < warmup:
            return (step + 1) / warmup  # + 1: the first step trains (transformers' schedule starts at 0)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
