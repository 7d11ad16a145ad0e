"""The slides' own loops, in their current-API form: the references the course measures against.

``train_pytorch`` is the slide "PyTorch による混合精度トレーニング" (``torch.autocast`` + ``GradScaler``),
``train_accelerate`` the slide "Accelerator による混合精度トレーニング". Lesson 03 shows both functions
line for line (a test keeps the lesson's text equal to these), and the benchmark times them against
``Trainer`` and the course's loop (``course_lib.training.loop``).
"""

from __future__ import annotations

import torch

from course_lib.devices import to_device
from course_lib.mixed_precision import autocast_dtype


def train_pytorch(
    model,
    train_dataloader,
    optimizer,
    lr_scheduler,
    precision,
    max_norm=1.0,
    init_scale=2.0**16,
    on_step=None,
):
    # The slide's loop in its current form. precision: "no" | "fp16" | "bf16".
    device = next(model.parameters()).device
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=precision == "fp16")
    model.train()
    losses = []
    for batch in train_dataloader:
        batch = to_device(batch, device)
        inputs, targets = batch["input_ids"], batch["labels"]
        with torch.autocast(
            device_type=device.type, dtype=autocast_dtype(precision), enabled=precision != "no"
        ):
            outputs = model(inputs, attention_mask=batch["attention_mask"], labels=targets)
            loss = outputs.loss
        scaler.scale(loss).backward()  # scaled loss -> scaled gradients (fp16 only)
        scaler.unscale_(optimizer)  # true gradients again, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        scaler.step(optimizer)  # skipped if a gradient is inf/nan
        scaler.update()  # adjust the scale for the next step
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step:
            on_step()
    return losses, scaler


def train_accelerate(
    accelerator, model, train_dataloader, optimizer, lr_scheduler, max_norm=1.0, on_step=None
):
    # The slide's loop through an Accelerator: pass what accelerator.prepare returned.
    model.train()
    losses = []
    for batch in train_dataloader:
        inputs, targets = batch["input_ids"], batch["labels"]
        outputs = model(inputs, attention_mask=batch["attention_mask"], labels=targets)
        loss = outputs.loss
        accelerator.backward(loss)  # scales the loss when a GradScaler is in use (fp16 on GPU)
        accelerator.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step:
            on_step()
    return losses
