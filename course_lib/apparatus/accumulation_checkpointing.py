"""Lesson 04's checkpointing apparatus (the module keeps the lesson's name; accumulation's is in ``accumulation``).

* how often each transformer layer's forward runs, counted by hooks (a checkpointed layer runs twice:
  forward, then again in backward), the compute ratio those counts imply, and forward and backward
  timed apart to predict what recomputing the layers costs;
* the sqrt(n) idea (Chen et al. 2016) on a synthetic stack of n Linear + GELU blocks: bytes saved for
  backward without checkpointing and with ``checkpoint_sequential`` in about sqrt(n) segments (the lesson
  shows ``stack_saved_bytes`` line for line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from course_lib.devices import to_device
from course_lib.instruments.memory import SavedTensors
from course_lib.instruments.timing import Stopwatch, median


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
            out = torch.utils.checkpoint.checkpoint_sequential(stack, segments, x, use_reentrant=False)
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


def plot_idea():
    """The lesson's picture: k micro-batches added up before one update; a layer's input kept, the rest recomputed."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from course_lib import plots  # noqa: F401  (Japanese labels)

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 3.4))
    for ax in (left, right):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 6)
        ax.axis("off")

    def box(ax, x, y, w, h, text, color, hatch=None):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", hatch=hatch))
        label = ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)
        if hatch:  # the label stays readable over the hatching
            label.set_bbox({"facecolor": "white", "edgecolor": "none"})

    def arrow(ax, start, end):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="->", mutation_scale=12))

    left.set_title("勾配累積: 8 行 × 4 回のバックワードパス、更新は 1 回")
    box(left, 0.2, 4.3, 6.4, 1.0, "32 行のバッチを一度に（活性化 32 行分）", "0.85")
    arrow(left, (6.7, 4.8), (7.9, 4.8))
    for i in range(4):
        box(left, 0.2 + 1.65 * i, 1.6, 1.4, 1.0, "8 行", "#9ecae1")
        arrow(left, (0.9 + 1.65 * i, 1.5), (0.9 + 1.65 * i, 0.95))
    box(left, 0.2, 0.2, 6.4, 0.7, ".grad に足す（活性化は 8 行分だけ）", "#deebf7")
    arrow(left, (6.7, 0.55), (7.9, 3.2))
    box(left, 8.0, 3.0, 1.8, 2.2, "同じ\n更新\n1 回", "#a1d99b")

    right.set_title("活性化チェックポイント: 層の入力だけ残し、再計算する")
    for row, (label, y) in enumerate((("なし", 3.6), ("あり", 0.8))):
        right.text(0.0, y + 0.6, label, ha="left", va="center", fontsize=10)
        for layer in range(3):
            x = 1.2 + 2.9 * layer
            box(right, x, y, 0.8, 1.2, "入力", "#fdae6b")
            kept = row == 0
            box(
                right,
                x + 0.8,
                y,
                1.8,
                1.2,
                "活性化" if kept else "捨てて再計算",
                "moccasin" if kept else "white",
                None if kept else "//",
            )
    right.text(5.5, 2.6, "バックワードパスで層のフォワードパスをもう 1 回", ha="center", fontsize=9)
    fig.tight_layout()
    return fig
