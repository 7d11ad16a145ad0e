"""The memory model checked against measurement: each part and each branch of the peak, measured.

``measure`` runs steps of a real model and reads the course's instruments only (``SavedTensors``,
``model_state_bytes``, ``TensorPeak``): the parts of ``memory_model.PARTS`` and, on their own, the
three branches of the step's peak (``memory_model.BRANCHES``): the forward's fullest moment, the
backward's and the optimizer step's, each above the weights and optimizer state held before the step.
``check_grid`` compares ``memory_model.predict`` with it over a list of setups; ``worst_errors`` sums
the grid up.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from course_lib.instruments.memory import SavedTensors, TensorPeak, model_state_bytes, tensor_bytes
from course_lib.memory_model import BRANCHES, PARTS, Arch, Setup, predict


def single_layer_step_peak(optimizer: str, shape: tuple[int, int] = (512, 512)) -> float:
    """Measured peak bytes of a second ``step()`` on one weight of ``shape``, per element (``TensorPeak``)."""
    from course_lib.training.optim import make_optimizer

    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    opt = make_optimizer(layer, 1e-3, 0.0, name=optimizer)
    gen = torch.Generator().manual_seed(0)
    layer.weight.grad = torch.randn(layer.weight.shape, generator=gen)
    opt.step()  # the first step creates the state
    peak = TensorPeak("cpu")
    peak.start()
    opt.step()
    return peak.stop() * 2**20 / layer.weight.numel()  # TensorPeak reports MiB


def matmul_workspace(arch: Arch, setup: Setup, device="cpu") -> int:
    """The largest scratch memory a linear layer of ``arch`` takes on ``device`` beside its output, measured.

    Each of the block's linear shapes (q/k/v/out: dim -> dim; lin1: dim -> hidden; lin2: hidden -> dim)
    runs once on ``setup``'s tokens in the dtype autocast gives it; its peak (``TensorPeak``) minus its
    output's bytes is the kernel's own. What it is depends on the kernel, not on the model: 0 for fp32
    on a CPU; the CPU's bf16 kernels take some, with or without bf16 instructions (measured: 67-264 KB
    on an AMD EPYC with AVX512-BF16, 131-524 KB on an Intel Xeon without them).
    """
    dtype = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[setup.precision]
    tokens, d, f = setup.batch * setup.seq_len, arch.dim, arch.hidden_dim
    gen, worst = torch.Generator().manual_seed(0), 0
    for n_in, n_out in ((d, d), (d, f), (f, d)):
        x = torch.randn(tokens, n_in, generator=gen).to(device, dtype)
        w = torch.randn(n_out, n_in, generator=gen).to(device, dtype)
        b = torch.randn(n_out, generator=gen).to(device, dtype)
        out, peak = _window(lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b), device)
        worst = max(worst, int(peak) - tensor_bytes([out]))
    return worst


def _window(fn, device, probe: int = 0):
    """``fn()``'s result and the peak bytes above the start while it runs (``TensorPeak``).

    With ``probe`` > 0, a tensor of ``probe`` bytes is allocated and freed right after ``fn()``: when
    it is larger than any peak inside ``fn()``, the window's peak minus it is the level, the bytes
    still held when ``fn()`` returns (a CPU has no allocator counter to read it from).
    """
    peak = TensorPeak(device)
    peak.start()
    out = fn()
    if probe:
        torch.empty(probe, dtype=torch.uint8, device=device)  # allocated and freed at once
    return out, peak.stop() * 2**20 - probe  # TensorPeak reports MiB


def measure(model: torch.nn.Module, batch: dict, setup: Setup, lr: float = 1e-4) -> dict[str, float]:
    """Measured bytes of each part (``PARTS``) and each branch (``BRANCHES``) on the model's device.

    Step 1 creates the optimizer state; weights, gradients and state are read after it
    (``model_state_bytes``). Every later step starts with the gradients freed, as ``predict`` assumes.
    Step 2: the peak of the forward (until autocast exits), of the backward and of ``step()``, each above
    its own start. Step 3: the levels where backward and ``step()`` start (``_window``'s probe) and what
    autograd saves (``SavedTensors``); a branch is its start level plus its own peak. Step 4: the peak
    of the whole step in one window. The model is trained in place.
    """
    from course_lib.training.activation_checkpointing import enable_checkpointing
    from course_lib.training.amp import TorchAmp
    from course_lib.training.optim import make_optimizer

    device = next(model.parameters()).device
    enable_checkpointing(model, setup.gradient_checkpointing)
    amp = TorchAmp(device, setup.precision)
    optimizer = make_optimizer(model, lr, 0.01, name=setup.optimizer)
    model.train()

    def forward():
        with amp.autocast():  # autocast's cache of 16-bit weight copies lives until this exits
            return model(**batch).loss

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward().backward()
    optimizer.step()
    states = model_state_bytes(model, optimizer)  # weights, gradients (.grad) and optimizer.state
    optimizer.zero_grad(set_to_none=True)

    loss, forward_peak = _window(forward, device)
    _, backward_peak = _window(loss.backward, device)
    _, step_peak = _window(step, device)
    probe = 2 * int(forward_peak + backward_peak + step_peak) + 2**20  # larger than any of them
    with SavedTensors() as saved:
        loss, backward_start = _window(forward, device, probe)
    _, step_start = _window(loss.backward, device, probe)
    step()
    del loss
    _, whole = _window(lambda: (forward().backward(), step()), device)
    enable_checkpointing(model, False)
    return {
        **states,
        "saved for backward": saved.bytes,
        "forward": forward_peak,
        "backward": backward_start + backward_peak,
        "optimizer step": backward_start + step_start + step_peak,
        "step peak": whole,
    }


def compare(predicted: dict[str, float], measured: dict[str, float], workspace: int = 0) -> list[dict]:
    """One row per part and branch: predicted and measured bytes, relative error (measured as reference).

    ``beyond_kernel``: the error left of a branch's *under*-prediction once a matmul kernel's own
    scratch memory (``workspace``, measured by ``matmul_workspace``: the model counts tensors, not what a
    kernel takes while it runs) is allowed for; over-predictions keep their whole error."""
    rows = []
    for part in (*PARTS, *BRANCHES):
        p, m = predicted[part], measured[part]
        error = abs(p - m) / m if m else 0.0
        short = m - p - (workspace if part in (*BRANCHES, "step peak") else 0)
        beyond = (max(short, 0) / m if p < m else error) if m else 0.0
        rows.append(
            {"part": part, "predicted": int(p), "measured": int(m), "error": error, "beyond_kernel": beyond}
        )
    return rows


def token_batch(arch: Arch, batch: int, seq_len: int, device="cpu", seed: int = 0) -> dict:
    """A batch of random token ids with no padding (the shapes the model assumes) and random labels."""
    gen = torch.Generator().manual_seed(seed)
    return {
        # ids from 5 up: no special token (the embedded vocabulary's [PAD] .. [MASK] are 0-4)
        "input_ids": torch.randint(5, arch.vocab_size, (batch, seq_len), generator=gen).to(device),
        "attention_mask": torch.ones(batch, seq_len, dtype=torch.long, device=device),
        "labels": torch.randint(0, arch.num_labels, (batch,), generator=gen).to(device),
    }


def random_model(arch: Arch) -> torch.nn.Module:
    """A DistilBERT for sequence classification of ``arch``'s shape with random weights (SDPA attention)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    fields = ("vocab_size", "dim", "hidden_dim", "n_layers", "n_heads", "max_position_embeddings")
    config = DistilBertConfig(**{k: getattr(arch, k) for k in fields}, num_labels=arch.num_labels)
    config.attention_dropout = arch.attention_dropout
    config._attn_implementation = arch.attention
    return DistilBertForSequenceClassification(config)


def check_grid(setups: list[Setup], device="cpu", seed: int = 0, arch: Arch | None = None) -> list[dict]:
    """Predicted against measured bytes of every part for each setup, on a fresh model each time: the
    embedded one, or a random one of ``arch``'s shape (``random_model``)."""
    from course_lib.models import load_model

    rows = []
    for setup in setups:
        torch.manual_seed(seed)  # the same random classifier head (or model) for every setup
        model = (random_model(arch) if arch else load_model()).to(device)
        arch_here = Arch.from_config(model.config)
        batch = token_batch(arch_here, setup.batch, setup.seq_len, device, seed)
        workspace = matmul_workspace(arch_here, setup, device)  # the kernel's own, measured here
        for row in compare(predict(arch_here, setup), measure(model, batch, setup), workspace):
            rows.append({**asdict(setup), **row})
    return rows


def worst_errors(rows: list[dict], key: str = "error") -> dict[str, float]:
    """The largest relative error (``key``: ``"error"`` or ``"beyond_kernel"``) of each part and branch."""
    return {part: max(r[key] for r in rows if r["part"] == part) for part in (*PARTS, *BRANCHES)}
