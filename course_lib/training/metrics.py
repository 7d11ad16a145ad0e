"""Evaluation: loss, accuracy and F1 on a validation DataLoader, computed locally (no ``evaluate.load``)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from course_lib.devices import to_device
from course_lib.mixed_precision import autocast_dtype, check_precision


def accuracy_f1(preds: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Accuracy and binary F1 (positive class 1), computed locally: no ``evaluate.load``."""
    preds, labels = preds.long().flatten(), labels.long().flatten()
    if preds.shape != labels.shape:
        raise ValueError(f"preds {tuple(preds.shape)} and labels {tuple(labels.shape)} differ in shape.")
    if labels.numel() == 0:
        raise ValueError("No predictions to score: the evaluation set is empty.")
    tp = ((preds == 1) & (labels == 1)).sum().item()
    fp = ((preds == 1) & (labels == 0)).sum().item()
    fn = ((preds == 0) & (labels == 1)).sum().item()
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0  # no true positive: F1 is 0 (and no 0 / 0)
    return {"accuracy": (preds == labels).float().mean().item(), "f1": f1}


@torch.no_grad()
def evaluate(model, dataloader, precision: str = "no", accelerator=None) -> dict[str, float]:
    """Loss, accuracy and F1 of ``model`` on ``dataloader``: means over rows, all processes' rows gathered.

    With an ``accelerator`` the prepared model autocasts itself and predictions are gathered from
    every process; without one, batches go to the model's device and ``precision`` sets autocast.
    """
    was_training = model.training
    model.eval()  # dropout off; restored below
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    precision = check_precision(precision, device) if accelerator is None else "no"
    autocast = (
        nullcontext
        if precision == "no"
        else lambda: torch.amp.autocast(device_type=device.type, dtype=autocast_dtype(precision))
    )
    all_preds, all_labels, all_losses = [], [], []
    for batch in dataloader:
        if accelerator is None:
            batch = to_device(batch, device)
        with autocast():
            out = model(**batch)
        preds, labels = out.logits.argmax(-1), batch["labels"]
        # per row, so a short last batch weighs by its rows and every process's rows count (out.loss is
        # this process's batch mean)
        losses = torch.nn.functional.cross_entropy(out.logits.float(), labels, reduction="none")
        if accelerator is not None:
            # every process's rows, minus the duplicates a DistributedSampler pads the last batch with
            preds, labels, losses = accelerator.gather_for_metrics((preds, labels, losses))
        all_preds.append(preds.cpu())
        all_labels.append(labels.cpu())
        all_losses.append(losses.cpu())
    if was_training:
        model.train()
    metrics = accuracy_f1(torch.cat(all_preds), torch.cat(all_labels))
    metrics["loss"] = torch.cat(all_losses).mean().item()  # the mean over rows
    return metrics
