"""Lesson 04's demonstrations: gradient accumulation and activation checkpointing, each measured.

* accumulation: cut a batch into micro-batches, run backward on each with its loss weighted
  (``micro_batch_weights``: ``"mean"``, loss / k, or ``"examples"``, loss x n_i / N, exact for unequal
  micro-batches and a short last window), and compare the gradients and the SGD update with those of
  the one big batch;
* the same update in three loops: ``StepRecorder`` hooks any optimizer (the course loop's, an
  Accelerator's, Trainer's) and keeps the parameters before and after every real step;
  ``compare_updates`` sets each update beside the exact one (SGD on the window's rows, at the same
  parameters and learning rate), so a loop that scales its gradients wrongly shows it as a ratio
  (Trainer with a model whose forward takes ``**kwargs``: k times the big batch's update);
* memory: peak tensor memory of one forward + backward over the micro-batches (``TensorPeak``), and
  the time of that forward + backward, the same rows as one batch or as micro-batches;
* checkpointing: how often each transformer layer's forward runs, counted by hooks (a checkpointed
  layer runs twice: forward, then again in backward), the compute ratio those counts imply, and
  forward and backward timed apart to predict what recomputing the layers costs;
* the sqrt(n) idea (Chen et al. 2016) on a synthetic stack of n Linear + GELU blocks: bytes saved for
  backward without checkpointing and with ``checkpoint_sequential`` in about sqrt(n) segments.

About 500 lines because lesson 04 teaches two techniques and compares three loops; the sections
below (accumulation, the loops' updates, checkpointing, sqrt(n)) each serve one part of the lesson.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
from torch.utils.checkpoint import checkpoint_sequential

from course_lib.devices import to_device
from course_lib.distributed import flat_grads, flat_params, max_abs_diff
from course_lib.instruments.memory import SavedTensors, TensorPeak
from course_lib.instruments.timing import Stopwatch, median

WEIGHTINGS = ("mean", "examples")


# ---------------------------------------------------------------- accumulation


def split_batch(batch: Mapping[str, torch.Tensor], sizes: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """Cut ``batch`` (tensors of shape (B, ...)) into consecutive micro-batches of ``sizes`` rows."""
    rows = {len(v) for v in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"The batch's tensors disagree on the number of rows: {sorted(rows)}.")
    (total,) = rows
    if not sizes or any(n < 1 for n in sizes) or sum(sizes) != total:
        raise ValueError(
            f"sizes {list(sizes)} must be positive and add up to the batch's {total} rows, "
            f"e.g. [{total // 2}, {total - total // 2}]."
        )
    out, start = [], 0
    for n in sizes:
        out.append({key: value[start : start + n] for key, value in batch.items()})
        start += n
    return out


def micro_batch_weights(
    sizes: Sequence[int], weighting: str = "examples", k: int | None = None
) -> list[float]:
    """The factor each micro-batch's mean loss is multiplied by before its backward.

    ``"mean"``: 1 / k for each (``k`` defaults to ``len(sizes)``, the window's length, as the course
    loop does; Accelerate uses its fixed k, also for the short last window of an epoch).
    ``"examples"``: n_i / sum(n), so that the window's loss is the mean over all its examples,
    whatever the micro-batch sizes.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}.")
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of positive row counts, got {list(sizes)}.")
    if weighting == "mean":
        k = len(sizes) if k is None else k
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        return [1.0 / k] * len(sizes)
    total = sum(sizes)
    return [n / total for n in sizes]


def rows(batch: Mapping[str, torch.Tensor]) -> int:
    """Number of examples in a batch (the length of its ``labels``)."""
    return len(batch["labels"])


def accumulate(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    weighting: str = "examples",
    k: int | None = None,
) -> float:
    """Forward + backward on each micro-batch, its loss weighted per ``weighting``; returns the window's loss.

    The gradients add up in each parameter's ``.grad`` (reset them before, step after).
    """
    weights = micro_batch_weights([rows(mb) for mb in micro_batches], weighting, k)
    device = next(model.parameters()).device
    total = 0.0
    for mb, weight in zip(micro_batches, weights):
        # weighted before backward: the .grad that the micro-batches add up is the window's
        loss = model(**to_device(dict(mb), device)).loss * weight
        loss.backward()
        total += loss.item()  # note: a CPU-GPU sync point
    return total


def accumulated_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    weighting: str = "examples",
    k: int | None = None,
) -> torch.Tensor:
    """All gradients, flattened, after ``accumulate`` on a copy of ``model`` (``model`` is left as is)."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    accumulate(work, micro_batches, weighting, k)
    return flat_grads(work)


def sgd_update(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    lr: float = 1.0,
    weighting: str = "examples",
    k: int | None = None,
) -> torch.Tensor:
    """All parameters, flattened, after one SGD step over ``micro_batches`` on a copy of ``model``."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(work.parameters(), lr=lr)
    accumulate(work, micro_batches, weighting, k)
    optimizer.step()
    return flat_params(work)


def step_peak_mb(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    device: torch.device | str | None = None,
) -> float:
    """Peak tensor memory (MiB) of one forward + backward over ``micro_batches`` (gradients reset first).

    Measured with ``TensorPeak`` above what was allocated at the start: activations, the gradient
    buffers (allocated by the first backward), temporaries. The batches are moved to the device first.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    batches = [to_device(dict(mb), device) for mb in micro_batches]
    model.zero_grad(set_to_none=True)  # None: the first backward allocates .grad inside the measurement
    peak = TensorPeak(device)
    peak.start()
    try:
        accumulate(model, batches, "examples")
    finally:
        mb = peak.stop()
    model.zero_grad(set_to_none=True)
    return mb


def accumulation_seconds(
    model: torch.nn.Module,
    splits: Mapping[str, Sequence[Mapping[str, torch.Tensor]]],
    warmup: int = 1,
    repeat: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Median seconds of one forward + backward over each split's micro-batches (``accumulate``).

    ``splits``: ``{name: micro_batches}``, e.g. the same rows as one batch and as k micro-batches. The
    splits take turns in every repeat (load that changes during the measurement hits all of them alike).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}.")
    device = next(model.parameters()).device
    batches = {name: [to_device(dict(mb), device) for mb in mbs] for name, mbs in splits.items()}
    watch, times = Stopwatch(device), {name: [] for name in splits}
    model.train()
    for i in range(warmup + repeat):
        for name, micro in batches.items():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)  # the same dropout masks in every repeat
            t0 = watch.now()
            accumulate(model, micro, "examples")
            if i >= warmup:
                times[name].append(watch.now() - t0)
    model.zero_grad(set_to_none=True)
    return {name: median(v) for name, v in times.items()}


class StepRecorder:
    """The parameters before and after every real ``optimizer.step()``, and the learning rate it used.

    Hooks on the (torch) optimizer itself, so it sees the steps of any loop that drives it: the
    course's, an ``Accelerator``'s (whose wrapper skips ``step()`` between updates) or ``Trainer``'s.
    Register it before ``accelerator.prepare`` / ``Trainer(...)``; ``remove()`` takes the hooks off.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.model = model
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, optimizer, args, kwargs) -> None:
        self.before.append(flat_params(self.model))
        # Trainer's two groups (decay, no decay) share one lr
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def _post(self, optimizer, args, kwargs) -> None:
        self.after.append(flat_params(self.model))

    def updates(self) -> list[torch.Tensor]:
        """Each step's change of all parameters (after - before), flattened."""
        return [a - b for a, b in zip(self.after, self.before)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def exact_update(
    model: torch.nn.Module, params: torch.Tensor, window: Mapping[str, torch.Tensor], lr: float
) -> torch.Tensor:
    """The SGD update of the mean loss over all rows of ``window``, from the flat ``params`` (``model`` is the architecture)."""
    work = copy.deepcopy(model)
    # the copy starts from the recorded parameters, not from the model's current ones
    torch.nn.utils.vector_to_parameters(params.to(next(work.parameters()).device), work.parameters())
    return sgd_update(work, [window], lr=lr) - params


def compare_updates(
    recorder: StepRecorder,
    model: torch.nn.Module,
    windows: Sequence[Mapping[str, torch.Tensor]],
    tol: float,
) -> list[dict]:
    """Each recorded step beside the exact update of its window (same parameters, same learning rate).

    One row per window: its rows, the norms of both updates, their ratio and whether they agree
    within ``tol`` (largest absolute difference). ``windows[i]`` holds all rows of step i's window.
    """
    if len(recorder.after) != len(windows):
        raise ValueError(
            f"The recorder saw {len(recorder.after)} optimizer steps but {len(windows)} windows were given: "
            "pass one batch per step, holding all rows of that step's window."
        )
    out = []
    for i, (update, before, lr, window) in enumerate(
        zip(recorder.updates(), recorder.before, recorder.lrs, windows)
    ):
        exact = exact_update(model, before, window, lr)
        out.append(
            {
                "window": i + 1,
                "rows": rows(window),
                "update norm": update.norm().item(),
                "exact norm": exact.norm().item(),
                "ratio": (update.norm() / exact.norm()).item(),
                "same": max_abs_diff(update, exact) < tol,
            }
        )
    return out


# ---------------------------------------------------------------- checkpointing


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks a Hugging Face model checkpoints (``GradientCheckpointingLayer``), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no GradientCheckpointingLayer: pass a Hugging Face transformer "
            "model (e.g. course_lib.models.load_model())."
        )
    return layers


class LayerRuns:
    """How often each layer's forward runs, counted by forward pre-hooks on the layer's direct children.

    transformers keeps a checkpointed layer's own hooks outside the checkpoint (so that hooks run once
    per step), so the count is taken one level down, where backward's recompute runs them again. A
    layer's runs are the most calls any of its children saw: torch stops a recompute as soon as it
    has what backward needs (``early_stop``), so the last child may not run again. Use as a context
    manager, or call ``remove()``.
    """

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.calls: list[dict[str, int]] = []
        self._handles = []
        for layer in layers:
            children = dict(layer.named_children())
            if not children:
                raise ValueError(f"{type(layer).__name__} has no child modules to count the forward runs of.")
            calls = dict.fromkeys(children, 0)
            self.calls.append(calls)
            for name, child in children.items():
                # one level down: a layer's own hooks run outside its checkpoint
                self._handles.append(child.register_forward_pre_hook(self._counter(calls, name)))

    @staticmethod
    def _counter(calls: dict[str, int], name: str):
        def hook(module, args) -> None:
            calls[name] += 1

        return hook

    def runs(self) -> list[int]:
        """Forward runs of each layer so far."""
        # max: a recompute may stop (early_stop) before the last child
        return [max(calls.values()) for calls in self.calls]

    def reset(self) -> None:
        for calls in self.calls:
            for name in calls:
                calls[name] = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> LayerRuns:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def layer_runs_per_step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Forward runs of each transformer layer in one forward + backward of ``model`` on ``batch``."""
    device = next(model.parameters()).device
    with LayerRuns(checkpointed_layers(model)) as counter:
        model(**to_device(dict(batch), device)).loss.backward()
        runs = counter.runs()
    model.zero_grad(set_to_none=True)
    return runs


def compute_ratio(plain_runs: int, runs: int) -> float:
    """Compute of a step relative to the plain step, in forward passes of the layers.

    The plain step costs 1 forward + 2 for backward (two matrix products per forward one) per layer
    run; every extra forward run (a recompute) adds 1: ``(runs + 2 plain_runs) / (3 plain_runs)``.
    """
    if plain_runs < 1 or runs < plain_runs:
        raise ValueError(f"Need 1 <= plain_runs <= runs, got plain_runs={plain_runs}, runs={runs}.")
    return (runs + 2 * plain_runs) / (3 * plain_runs)


def time_phases(
    models: Mapping[str, torch.nn.Module],
    batch: Mapping[str, torch.Tensor],
    warmup: int = 1,
    repeat: int = 3,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Median seconds of the forward (with the loss), of the backward, and of the layers' forward.

    The models take turns in every repeat (load that changes during the measurement hits all of
    them alike). ``layers forward``: the time spent inside the transformer layers' forward during
    the (first) forward, read by hooks on the layers: what a checkpointed step runs once more.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}.")
    times = {name: {"forward": [], "backward": [], "layers forward": []} for name in models}
    for i in range(warmup + repeat):
        for name, model in models.items():
            device = next(model.parameters()).device
            watch, inside, started = Stopwatch(device), [0.0], []

            # defaults bind this iteration's objects (ruff B023), though the hooks die within it
            def pre(module, args, watch=watch, started=started) -> None:
                started.append(watch.now())

            def post(module, args, output, watch=watch, started=started, inside=inside) -> None:
                inside[0] += watch.now() - started.pop()  # a stack: pre/post pairs may nest

            handles = []
            for layer in checkpointed_layers(model):
                handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
            work = to_device(dict(batch), device)
            model.train()
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)  # the same dropout masks for every model and repeat
            try:
                t0 = watch.now()
                loss = model(**work).loss
                t1 = watch.now()
                loss.backward()
                t2 = watch.now()
            finally:
                for handle in handles:
                    handle.remove()
            if i >= warmup:
                times[name]["forward"].append(t1 - t0)
                times[name]["backward"].append(t2 - t1)
                times[name]["layers forward"].append(inside[0])
    return {name: {phase: median(v) for phase, v in phases.items()} for name, phases in times.items()}


def predicted_ratio(forward: float, backward: float, layers_forward: float) -> float:
    """Time of a checkpointed step over a plain one if the layers' forward runs once more in backward."""
    if forward <= 0 or backward <= 0 or not 0 <= layers_forward <= forward:
        raise ValueError(
            f"Need forward > 0, backward > 0 and 0 <= layers_forward <= forward, got {forward}, {backward}, "
            f"{layers_forward}: pass the medians of time_phases."
        )
    return (forward + backward + layers_forward) / (forward + backward)


# ---------------------------------------------------------------- sqrt(n) on a synthetic stack


def linear_gelu_stack(n: int, width: int = 64, seed: int = 0) -> torch.nn.Sequential:
    """``n`` blocks of Linear(width, width) + GELU, seeded: a deep network with one activation size."""
    if n < 1 or width < 1:
        raise ValueError(f"n and width must be >= 1, got n={n}, width={width}.")
    with torch.random.fork_rng(devices=[]):  # seeded here, the caller's random stream untouched
        torch.manual_seed(seed)
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(n)]
    return torch.nn.Sequential(*blocks)


def sqrt_segments(n: int) -> int:
    """About sqrt(n) segments, at least 1 and at most n."""
    return max(1, min(n, round(math.sqrt(n))))


def stack_saved_bytes(stack: torch.nn.Sequential, x: torch.Tensor, segments: int | None = None) -> int:
    """Bytes saved for backward by one forward of ``stack`` on ``x`` (then backward, to free them).

    ``segments=None``: no checkpointing, every block keeps its activations. Otherwise
    ``checkpoint_sequential(stack, segments, x, use_reentrant=False)``: each checkpointed segment keeps
    only its input; the last segment runs normally (its output is needed at once).
    """
    if segments is not None and not 1 <= segments <= len(stack):
        raise ValueError(
            f"segments must be between 1 and {len(stack)} (the number of blocks), got {segments}."
        )
    with SavedTensors() as saved:
        if segments is None:
            out = stack(x)
        else:
            out = checkpoint_sequential(stack, segments, x, use_reentrant=False)
    out.sum().backward()  # backward frees what was saved
    stack.zero_grad(set_to_none=True)
    return saved.bytes


def sqrt_n_rows(ns: Sequence[int], width: int = 64, batch: int = 512, seed: int = 0) -> list[dict]:
    """Bytes saved for backward for each depth ``n``: no checkpointing vs about sqrt(n) segments."""
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))  # one input for every depth
    rows_out = []
    for n in ns:
        stack = linear_gelu_stack(n, width, seed)
        segments = sqrt_segments(n)
        rows_out.append(
            {
                "n": n,
                "segments": segments,
                "plain": stack_saved_bytes(stack, x),
                "checkpointed": stack_saved_bytes(stack, x, segments),
            }
        )
    return rows_out


def plot_sqrt_n(table: Sequence[Mapping[str, int]], ax=None):
    """Saved bytes (MiB) against depth n: no checkpointing (grows like n) vs sqrt(n) segments."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 3.5))
    ns = [r["n"] for r in table]
    ax.plot(ns, [r["plain"] / 2**20 for r in table], "o-", label="no checkpointing (~ n)")
    ax.plot(
        ns,
        [r["checkpointed"] / 2**20 for r in table],
        "s-",
        label="checkpoint_sequential, ~sqrt(n) segments",
    )
    ax.set_xlabel("number of blocks n (Linear + GELU)")
    ax.set_ylabel("saved for backward (MiB)")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax
