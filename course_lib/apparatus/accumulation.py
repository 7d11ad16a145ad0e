"""Lesson 04's accumulation apparatus: the window's loop, and its update set beside the big batch's.

* ``accumulate``: forward + backward on each micro-batch, its loss weighted (``"examples"``: loss x n_i / N,
  exact for unequal micro-batches and a short last window; ``"mean"``: loss / k); the lesson shows it
  line for line; ``accumulated_gradients`` and ``sgd_update`` run it on a copy of the model;
* the same update in three loops: ``StepRecorder`` hooks any optimizer (the course loop's, an
  Accelerator's, Trainer's) and keeps the parameters before and after every real step;
  ``compare_updates`` sets each update beside the exact one (SGD on the window's rows, at the same
  parameters and learning rate), so a loop that scales its gradients wrongly shows it as a ratio;
* memory and time: peak tensor memory of one forward + backward over the micro-batches (``TensorPeak``),
  and the time of it, the same rows as one batch or as micro-batches.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from course_lib.devices import to_device
from course_lib.distributed import flat_grads, flat_params, max_abs_diff
from course_lib.instruments.memory import TensorPeak
from course_lib.instruments.timing import Stopwatch, median


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


def rows(batch: Mapping[str, torch.Tensor]) -> int:
    """Number of examples in a batch (the length of its ``labels``)."""
    return len(batch["labels"])


def accumulate(
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    weighting: str = "examples",
    k: int | None = None,
) -> float:
    """Forward + backward on each micro-batch, its loss weighted; returns the window's loss.

    ``"examples"``: loss x n_i / N, the micro-batch's share of the window's N rows (exact for any sizes);
    ``"mean"``: loss / k (``k``: the window's micro-batches unless given; Accelerate keeps its fixed k).
    The gradients add up in each parameter's ``.grad`` (reset them before, step after).
    """
    k = len(micro_batches) if k is None else k
    if weighting not in ("examples", "mean") or not micro_batches or k < 1:
        raise ValueError(
            f'Need weighting "examples" or "mean", micro-batches and k >= 1, got {weighting!r}, k={k}.'
        )
    total_rows = sum(len(mb["labels"]) for mb in micro_batches)  # N: the window's rows, counted first
    device = next(model.parameters()).device
    window_loss = 0.0
    for mb in micro_batches:
        loss = model(**to_device(dict(mb), device)).loss  # the micro-batch's mean loss
        if weighting == "examples":
            loss = loss * (len(mb["labels"]) / total_rows)  # n_i / N: its share of the window's rows
        else:
            loss = loss / k  # right only when every micro-batch has the same number of rows
        loss.backward()  # weighted before backward: the .grad the micro-batches add up is the window's
        window_loss += loss.item()  # note: a CPU-GPU sync point
    return window_loss


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


def plot_update_ratios(comparisons: Mapping[str, Sequence[Mapping]], ax=None):
    """Bars: each loop's update over the exact one (``compare_updates`` rows), window by window.

    A bar at 1 is the big batch's update; Trainer's default shows k, Accelerate's short window 1/k.
    """
    import matplotlib.pyplot as plt

    from course_lib import plots  # noqa: F401  (Japanese labels)

    if ax is None:
        _, ax = plt.subplots(figsize=(7.0, 3.4))
    names = list(comparisons)
    n_windows = max(len(rows) for rows in comparisons.values())
    width = 0.8 / n_windows
    for w in range(n_windows):
        xs = [i + (w - (n_windows - 1) / 2) * width for i in range(len(names))]
        ratios = [rows[w]["ratio"] if w < len(rows) else 0.0 for rows in comparisons.values()]
        label = f"窓 {w + 1}（{comparisons[names[0]][w]['rows']} 行）"
        bars = ax.bar(xs, ratios, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), [name.replace(", ", "\n") for name in names], fontsize=8)
    ax.set_ylabel("更新の大きさ / 正確な更新")
    ax.set_title("1 が大きなバッチと同じ更新")
    ax.legend(fontsize=8)
    return ax
