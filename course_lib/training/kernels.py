"""[kernels] Which kernels compute the same model: the attention implementation and ``torch.compile``.

Neither changes the function the model computes (a test checks the losses agree within rounding);
both change how fast it runs, and which is faster depends on the hardware, the shapes and the run's
length, so the recipe ladder measures them (``python -m course_lib.cli.recipe``).

* ``attn_implementation``  ``"eager"`` (matmul, softmax, matmul, as the paper writes it) or ``"sdpa"``
  (``torch.nn.functional.scaled_dot_product_attention``: a fused kernel where the device has one)
* ``compile``              ``torch.compile``: the forward and backward traced into graphs and fused
  kernels generated once; compilation is paid at the first steps (and at new shapes), and counts in
  a run's wall time.
"""

from __future__ import annotations

import torch

ATTENTION = ("eager", "sdpa")


def set_attention(model: torch.nn.Module, implementation: str | None) -> torch.nn.Module:
    """Switch a Hugging Face model to ``implementation`` (None: leave it as loaded); returns the model."""
    if implementation is None:
        return model
    if implementation not in ATTENTION:
        raise ValueError(
            f"attn_implementation must be one of {', '.join(ATTENTION)}, got {implementation!r}."
        )
    if implementation == "sdpa" and not getattr(model, "_supports_sdpa", False):
        raise ValueError(f"{type(model).__name__} has no SDPA attention in this transformers: use 'eager'.")
    model.set_attn_implementation(implementation)
    return model


def compiled(model: torch.nn.Module, enabled: bool, dynamic: bool | None = None) -> torch.nn.Module:
    """``torch.compile(model)`` when ``enabled`` (the same parameters: the uncompiled model evaluates)."""
    if not enabled:
        return model
    # The first forward pass sets config.problem_type; fixed here, it does not force a second compilation.
    config = getattr(model, "config", None)
    if (
        config is not None
        and getattr(config, "problem_type", "") is None
        and getattr(config, "num_labels", 0) > 1
    ):
        config.problem_type = "single_label_classification"
    # dynamic=True where batches change length (dynamic padding): not a new graph for every new length
    return torch.compile(model, dynamic=dynamic)
