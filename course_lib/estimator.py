"""How many bytes one device needs to fine-tune a model, from the memory model, as an interactive chart.

``estimate`` turns a model size, sequence length, micro-batch, precision, optimizer, activation
checkpointing, ZeRO stage and number of devices into bytes per device, one stacked part each
(weights, gradients, optimizer state, activations saved for backward, the step's temporaries), from
``course_lib.memory_model``. ``estimator()`` is the ipywidgets front end: the stacked bar against the
memory of a device the learner picks. A prediction, not a measurement: the lesson checks the model
against measurements on the embedded model; on a GPU the attention kernel is taken to be a fused one
(``Arch(attention="flash")``), which this course has not measured.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

from course_lib import memory_model as mm
from course_lib.models import EMBEDDED_MODEL_DIR

GIB = 2**30
MODELS: dict[str, mm.Arch] = {
    "embedded (tiny DistilBERT)": mm.Arch.from_config(
        SimpleNamespace(**json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text(encoding="utf-8")))
    ),
    "DistilBERT-base": mm.Arch(30522, 768, 3072, 6, 12, 512),
    "7B-sized (DistilBERT-shaped)": mm.Arch(32000, 4096, 16384, 32, 32, 4096),
}
DEVICES: dict[str, float] = {"laptop (16 GiB)": 16 * GIB, "24 GiB GPU": 24 * GIB, "80 GiB GPU": 80 * GIB}
STACK = ("weights", "gradients", "optimizer state", "activations", "temporaries")
# 8-bit AdamW's step temporary is the CPU kernel's (memory_model.step_temporary): say so under a GPU
GPU_8BIT_NOTE = (
    "8-bit AdamW's temporaries: the CPU kernel's 20 B per element of the largest tensor; "
    "a GPU's kernel dequantises in registers (not measured here)"
)


def notes(device: str, optimizer: str) -> list[str]:
    """What the estimate for ``device`` (a ``DEVICES`` name) and ``optimizer`` takes from the CPU only."""
    return [GPU_8BIT_NOTE] if "GPU" in device and optimizer == "adamw8bit" else []


def estimate(
    arch: mm.Arch, setup: mm.Setup, stage: str = "ddp", devices: int = 1, bucket_view: bool = True
) -> dict[str, float]:
    """Predicted bytes per device, one entry per ``STACK`` part, plus ``total``.

    Weights, gradients and optimizer state as ``memory_model.per_rank`` shards them; the activations
    are each device's own micro-batch (what autograd saves, parameters excluded); the temporaries are
    what the largest branch of the step's peak (``memory_model.BRANCHES``: the forward with autocast's
    weight cache, the backward, the optimizer step, each with this device's gradients) adds on top of
    the gradients and the activations, plus, when sharded, one transformer block's full gradients
    (ZeRO-2/3) and two blocks' gathered parameters (ZeRO-3).
    ``bucket_view``: DDP's (and ZeRO-1's) all-reduce buckets are the gradients themselves (PyTorch DDP's
    ``gradient_as_bucket_view=True``, as ``apparatus.sharding`` runs it); False: DDP's default, and
    Accelerate's, where the buckets are one more copy of the gradients, counted under "gradients".
    """
    parts = mm.predict(arch, setup)
    rank = mm.per_rank(parts, stage, devices)
    activations = sum(r["bytes"] for r in mm.saved_tensors(arch, setup) if not r["alias"])
    # DDP's default: the all-reduce buckets are a second copy of the gradients (measured: apparatus.sharding)
    copy = not bucket_view and stage in ("ddp", "zero1") and devices > 1
    held = rank["gradients"] * (2 if copy else 1)  # the gradients (and bucket copy) on this device
    # the peak's branches with this device's gradients: the forward holds none (autocast's cache instead)
    peak = max(
        parts["forward"],
        parts["backward"] - parts["gradients"] + held,
        held + mm.step_temporary(arch, setup.optimizer),
    )
    temporaries = max(0, peak - held - activations)  # 0 when the activations and gradients are the peak
    block = 4 * arch.block_numel()  # one transformer block's fp32 parameters (or gradients)
    if stage in ("zero2", "zero3") and devices > 1:
        temporaries += block  # one block's full gradients before they are reduce-scattered
    if stage == "zero3" and devices > 1:
        temporaries += 2 * block  # one block's gathered parameters, and the next one's prefetched
    out = {
        "weights": rank["weights"],
        "gradients": held,
        "optimizer state": rank["optimizer state"],
        "activations": float(activations),
        "temporaries": float(temporaries),
    }
    out["total"] = sum(out.values())
    return out


def describe_estimate(estimate_bytes: dict[str, float], device_bytes: float) -> str:
    """The estimate as text: each part in GiB and whether the total fits ``device_bytes``."""
    parts = ", ".join(f"{k} {estimate_bytes[k] / GIB:.2f}" for k in STACK)
    verdict = "fits" if estimate_bytes["total"] <= device_bytes else "does not fit"
    return f"per device (GiB): {parts} | total {estimate_bytes['total'] / GIB:.2f} of {device_bytes / GIB:.0f}: {verdict}"


def plot_estimate(estimate_bytes: dict[str, float], device_bytes: float, label: str = "", ax=None):
    """One stacked bar (GiB) of ``estimate_bytes`` with the device's memory as a line."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3.2))[1]
    bottom = 0.0
    for part in STACK:
        value = estimate_bytes[part] / GIB
        ax.bar([label or "per device"], [value], bottom=bottom, label=part)
        bottom += value
    ax.axhline(device_bytes / GIB, color="black", linestyle="--", label="device memory")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def estimator(model: str = "DistilBERT-base", device: str = "24 GiB GPU"):
    """The ipywidgets estimator (returns the widget), or the text of the default choice without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed (pip install ipywidgets): showing the text instead.")
        print(describe_estimate(estimate(MODELS[model], mm.Setup(8, 128)), DEVICES[device]))
        return None
    import matplotlib.pyplot as plt

    controls = {
        "model": w.Dropdown(options=list(MODELS), value=model, description="model"),
        "seq_len": w.IntSlider(value=128, min=16, max=4096, step=16, description="seq len"),
        "batch": w.IntSlider(value=8, min=1, max=64, description="batch"),
        "precision": w.Dropdown(options=list(mm.PRECISIONS), value="bf16", description="precision"),
        "optimizer": w.Dropdown(options=list(mm.OPTIMIZERS), value="adamw", description="optimizer"),
        "checkpointing": w.Checkbox(value=False, description="checkpointing"),
        "stage": w.Dropdown(options=list(mm.STAGES), value="ddp", description="ZeRO stage"),
        "devices": w.IntSlider(value=1, min=1, max=64, description="devices"),
        # unticked: DDP's and Accelerate's default (gradient_as_bucket_view=False): one more gradient copy
        "bucket_view": w.Checkbox(value=True, description="DDP bucket views"),
        "device": w.Dropdown(options=list(DEVICES), value=device, description="device"),
    }
    out = w.Output()

    def render(_change=None) -> None:
        c = {k: v.value for k, v in controls.items()}
        arch = MODELS[c["model"]]
        if "GPU" in c["device"]:
            arch = replace(arch, attention="flash")  # a fused attention kernel on GPUs (not measured here)
        seq_len = min(c["seq_len"], arch.max_position_embeddings)  # no longer than the model's position table
        setup = mm.Setup(c["batch"], seq_len, c["precision"], c["checkpointing"], c["optimizer"])
        est = estimate(arch, setup, c["stage"], c["devices"], c["bucket_view"])
        with out:
            out.clear_output(wait=True)
            ax = plot_estimate(est, DEVICES[c["device"]], c["model"])
            ax.set_title(describe_estimate(est, DEVICES[c["device"]]).split(" | ")[1], fontsize=9)
            plt.show()
            for note in notes(c["device"], c["optimizer"]):
                print("note:", note)

    for widget in controls.values():
        widget.observe(render, names="value")
    render()

    class MemoryEstimator(w.VBox):
        def __repr__(self) -> str:  # what a headless run (no front end) records instead of the view
            return "MemoryEstimator: interactive, open the notebook in Jupyter to use it"

    return MemoryEstimator([w.HBox(list(controls.values())[:5]), w.HBox(list(controls.values())[5:]), out])
