"""Lesson 06's demonstrations: what AdamW, Adafactor and 8-bit AdamW keep between steps, measured.

The lesson builds the optimizers in its own cells (``torch.optim.AdamW(...)``, ``torch.optim.Adafactor(...)``,
``bitsandbytes.optim.AdamW8bit(...)``) and reads ``optimizer.state[param]`` there; this module counts and
tabulates around them:

* state: the bytes an optimizer holds, read from ``optimizer.state`` after a step (each storage once:
  bitsandbytes shares its quantisation maps between parameters), per state key and per parameter;
  the layout of one parameter's state; which tensors bitsandbytes leaves in 32-bit (``min_8bit_size``).
* size: the same bytes on one large random layer, where the 8-bit saving reaches Dettmers et al.'s 75 %
  and Adafactor's factored second moment (n + m floats for an n x m matrix) is almost nothing.
* training: the same short fine-tune with each optimizer is the course loop's
  ``TrainConfig(optimizer=...)`` (``training.make_optimizer``); nothing of it lives here.
* accounting: bytes per parameter of mixed-precision training, ZeRO's way (Rajbhandari et al. 2020):
  fp16 weights 2 + fp16 gradients 2 + fp32 master weights 4 + the optimizer's state, or with any
  other measured base (the course's autocast: fp32 weights 4 + fp32 gradients 4).
* Trainer: the optimizer class and arguments a ``TrainingArguments(optim=...)`` name resolves to, and
  the optimizer ``Trainer.create_optimizer()`` builds, stepped once (for an 8-bit bitsandbytes optimizer
  Trainer keeps every ``nn.Embedding``'s state in 32-bit).
* step size per kind of parameter: the RMS of one step's change of weight matrices, LayerNorm gains
  and biases (Adafactor's step is relative to each tensor's RMS, AdamW's is not);
* the step's own memory: the peak of tensor memory inside ``optimizer.step()`` (temporaries that the
  persistent state does not show: Adafactor's one n x m buffer, the estimate turned into the update in
  place; 8-bit AdamW's dequantised moments).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import torch

from course_lib import memory_model
from course_lib.instruments.memory import TensorPeak, optimizer_state_bytes_by_key, tensor_bytes
from course_lib.instruments.timing import time_fn
from course_lib.memory_model import MIN_8BIT_SIZE
from course_lib.training.optim import OPTIMIZERS, import_bitsandbytes, make_optimizer

# Mixed-precision training as ZeRO counts it (fp16 weights and gradients, an fp32 master copy): bytes
# per parameter besides the optimizer's state. torch.autocast keeps fp32 weights and fp32 gradients
# instead (no master copy): measure those with instruments.memory.model_state_bytes.
ZERO_BASE = {"weights (fp16)": 2, "gradients (fp16)": 2, "master weights (fp32)": 4}


def _tensors(state: dict) -> Iterable[tuple[str, torch.Tensor]]:
    return ((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state per state key (``exp_avg``, ``state1``, ...), each storage once.

    Read after a step (the state is created in the first ``step()``). Step counters are left out and a
    storage shared by several parameters (bitsandbytes' quantisation maps ``qmap1``/``qmap2``) is
    counted once: ``instruments.memory.optimizer_state_bytes_by_key``, whose sum is
    ``optimizer_state_bytes``.
    """
    return optimizer_state_bytes_by_key(optimizer)


def optimizer_params(optimizer: torch.optim.Optimizer) -> int:
    """Number of parameters (elements) in all of the optimizer's parameter groups."""
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"])


def state_summary(name: str, optimizer: torch.optim.Optimizer) -> dict:
    """One table row: the state's bytes, bytes per parameter and the share of them in 8-bit (uint8)."""
    total = sum(state_bytes(optimizer).values())
    n = optimizer_params(optimizer)
    eight_bit = sum(
        t.numel() for s in optimizer.state.values() for _, t in _tensors(s) if t.dtype == torch.uint8
    )
    return {
        "optimizer": name,
        "state bytes": total,
        "bytes/param": round(total / n, 3),
        # 2 n: two moments per parameter
        "state in 8-bit": f"{eight_bit / (2 * n):.1%}" if "8bit" in name else "-",
    }


def state_layout(state: dict) -> list[dict]:
    """One parameter's state (``optimizer.state[param]``): each entry's shape, dtype and bytes.

    Python numbers (bitsandbytes' ``step``) are shown as such, with 0 bytes.
    """
    rows = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            rows.append(
                {"key": key, "shape": tuple(value.shape), "dtype": dtype, "bytes": tensor_bytes([value])}
            )
        else:
            rows.append({"key": key, "shape": "-", "dtype": type(value).__name__, "bytes": 0})
    return rows


def adafactor_state_numel(shape: Sequence[int]) -> int:
    """Elements of Adafactor's second-moment state for a parameter of ``shape`` (no first moment).

    A matrix (n, m) keeps a row vector (n) and a column vector (m): n + m instead of Adam's n x m. A
    tensor of more dimensions is factored over its last two; a vector keeps one value per element.
    """
    return memory_model.param_state(tuple(shape), "adafactor") // 4  # the memory model's bytes, fp32


def small_tensor_share(optimizer: torch.optim.Optimizer, min_8bit_size: int = MIN_8BIT_SIZE) -> dict:
    """How many parameter tensors (and elements) are below ``min_8bit_size``: bitsandbytes keeps them 32-bit."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    small = [p for p in params if p.numel() < min_8bit_size]
    return {
        "tensors": len(params),
        "small tensors": len(small),
        "elements": sum(p.numel() for p in params),
        "elements in small tensors": sum(p.numel() for p in small),
    }


def random_grad_step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], seed: int = 0
) -> None:
    """One ``step()`` on random gradients (creates the state without a model's forward pass)."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        # drawn on the CPU by a seeded generator: the same gradients on every device
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def weight_rms(model: torch.nn.Module) -> float:
    """Median root-mean-square of the model's weight matrices (the scale Adafactor's steps are relative to)."""
    values = [p.detach().float().pow(2).mean().sqrt().item() for p in model.parameters() if p.ndim >= 2]
    if not values:
        raise ValueError("The model has no weight matrices (parameters with 2 or more dimensions).")
    return statistics.median(values)


def step_seconds(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], repeat: int = 5
) -> float:
    """Median seconds of ``optimizer.step()`` alone (fixed random gradients; no forward or backward pass)."""
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
    seconds = time_fn(optimizer.step, warmup=1, repeat=repeat, device=params[0].device).median
    optimizer.zero_grad(set_to_none=True)
    return seconds


def layer_state_rows(n: int, m: int, names: Sequence[str] = OPTIMIZERS) -> list[dict]:
    """Bytes per parameter of each optimizer's state on one random ``Linear(m, n)`` weight (n x m), on the CPU."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(m, n, bias=False)
    rows = []
    for name in names:
        optimizer = make_optimizer(layer, lr=1e-3, weight_decay=0.0, name=name)
        random_grad_step(optimizer, [layer.weight])
        rows.append({"shape": f"{n} x {m}", **state_summary(name, optimizer)})
        del optimizer  # its state freed before the next optimizer builds one
    return rows


def zero_bytes_per_param(state_bytes_per_param: float, base: dict[str, float] | None = None) -> dict:
    """ZeRO's accounting of mixed-precision training per parameter: ``base`` + the optimizer's state.

    ``base`` defaults to ``ZERO_BASE`` (fp16 weights 2, fp16 gradients 2, fp32 master weights 4).
    With Adam's 8 bytes of state that is ZeRO's 16 bytes per parameter (K = 12 with the master copy).
    """
    row = dict(ZERO_BASE if base is None else base)
    row["optimizer state"] = state_bytes_per_param
    row["total"] = sum(row.values())
    return row


def trainer_optimizer(optim: str, output_dir: str, learning_rate: float = 5e-5) -> tuple[type, dict]:
    """The optimizer class and keyword arguments ``Trainer`` builds for ``TrainingArguments(optim=...)``.

    No model and no training: ``Trainer.get_optimizer_cls_and_kwargs`` reads only the arguments.
    """
    from transformers import Trainer, TrainingArguments

    if "bnb" in optim or "8bit" in optim:
        import_bitsandbytes()  # Trainer imports it: once quietly first
    args = TrainingArguments(output_dir=output_dir, optim=optim, learning_rate=learning_rate)
    return Trainer.get_optimizer_cls_and_kwargs(args)


def describe_trainer_optimizer(optim: str, output_dir: str, learning_rate: float = 5e-5) -> dict:
    """One table row: the ``optim=`` name, the class it builds and the arguments that tell them apart."""
    cls, kwargs = trainer_optimizer(optim, output_dir, learning_rate)
    shown = ("lr", "fused", "optim_bits", "relative_step", "scale_parameter")
    return {
        "optim=": optim,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "arguments": ", ".join(f"{k}={kwargs[k]}" for k in shown if k in kwargs),
    }


def trainer_stepped_optimizer(
    model: torch.nn.Module,
    batch: dict,
    optim: str,
    output_dir: str,
    learning_rate: float = 5e-5,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer()`` builds for ``model``, after one step on ``batch``.

    Trainer's own construction, not only its class and arguments (``trainer_optimizer``): for an 8-bit
    bitsandbytes optimizer it also registers every ``nn.Embedding``'s weight with bitsandbytes'
    ``GlobalOptimManager`` to keep 32-bit state, which shows in the state the step creates. Trainer
    moves ``model`` to its device; ``batch`` follows it.
    """
    from transformers import Trainer, TrainingArguments

    if "bnb" in optim or "8bit" in optim:
        import_bitsandbytes()  # Trainer imports it: once quietly first
    args = TrainingArguments(
        output_dir=output_dir, optim=optim, learning_rate=learning_rate, weight_decay=weight_decay
    )
    optimizer = Trainer(model=model, args=args).create_optimizer()
    try:
        device = next(model.parameters()).device
        model(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        optimizer.step()  # the state is created here, with Trainer's overrides applied
        optimizer.zero_grad(set_to_none=True)
    finally:
        if "bitsandbytes" in type(optimizer).__module__:
            # The overrides live in a process-wide manager, keyed by (group, index) too: cleared, so that
            # a later bitsandbytes optimizer in this process does not inherit them for its first params.
            import bitsandbytes

            bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()
    return optimizer


def embedding_share(model: torch.nn.Module) -> dict:
    """Elements of the model's ``nn.Embedding`` weights (Trainer keeps their 8-bit AdamW state 32-bit)."""
    embedded = {
        p.data_ptr(): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters()
    }
    return {"elements": sum(p.numel() for p in model.parameters()), "in embeddings": sum(embedded.values())}


PARAM_KINDS = ("weight matrices", "LayerNorm gains", "biases", "biases at zero")


def param_kind(name: str, param: torch.Tensor) -> str:
    """Which of ``PARAM_KINDS`` a named parameter is (``biases at zero``: all zeros, e.g. a new head)."""
    if param.ndim >= 2:
        return "weight matrices"
    if ("LayerNorm" in name or "layer_norm" in name) and name.endswith("weight"):
        return "LayerNorm gains"
    return "biases at zero" if not param.detach().any() else "biases"


def step_rms_by_kind(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per kind of parameter: how many tensors, the median RMS of their values before the step and of
    the step's change (``before``: ``{name: tensor}`` copied before ``optimizer.step()``)."""
    values: dict[str, list[tuple[float, float]]] = {}
    for name, p in model.named_parameters():
        if name not in before:
            raise ValueError(f"No value before the step for {name!r}: copy every named parameter first.")
        old = before[name].detach().float()
        change = (p.detach().float() - old).pow(2).mean().sqrt().item()
        values.setdefault(param_kind(name, old), []).append((old.pow(2).mean().sqrt().item(), change))
    return {
        kind: {
            "tensors": len(values[kind]),
            "value RMS": statistics.median(v for v, _ in values[kind]),
            "step RMS": statistics.median(c for _, c in values[kind]),
        }
        for kind in PARAM_KINDS
        if kind in values
    }


def optimizer_step_peak_mb(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], seed: int = 1
) -> float:
    """Peak tensor memory (MiB) allocated inside one ``optimizer.step()``, above what existed before it.

    Call it after a first step (the state exists, so only the step's temporaries count), on fixed
    random gradients. Measured with ``TensorPeak`` (the CUDA allocator's peak, or the CPU profiler's).
    """
    if not optimizer.state:
        raise ValueError(
            "The optimizer has no state yet: run one step first (e.g. random_grad_step(optimizer, params))."
        )
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
    peak = TensorPeak(params[0].device)  # gradients made before start(): only the step's own allocations
    peak.start()
    try:
        optimizer.step()
    finally:
        mb = peak.stop()
    optimizer.zero_grad(set_to_none=True)
    return mb
