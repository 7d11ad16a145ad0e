"""Lesson 05's records: what one rank sent and saw while one variant trained, and the tables and plots
that read those records.

``Recorder`` is what the lesson's loops (``apparatus.local_sgd``: ``ddp_loop``, ``local_sgd_loop``)
call after each micro-batch: it counts the all-reduce calls per step (DDP's gradients through the
counting comm hook, LocalSGD's parameter averages, the average on leaving its block), the validation
loss where the replicas agree, and how far the replicas are apart before and after each averaging
(``instruments.replicas``). It only measures; ``result`` is the plain dict a launch returns.
``count_rows``, ``plot_loss_vs_bytes``, ``drift_series`` and ``plot_drift`` read those dicts;
``plot_sync_timeline`` draws when each variant communicates, from the settings alone (the lesson's card).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.apparatus.local_sgd_counting import CommLog
from course_lib.distributed import flat_params, same_on_all_ranks
from course_lib.instruments.memory import MIB
from course_lib.instruments.replicas import mean_loss_over_ranks, replica_drift


@dataclass
class Recorder:
    """What one rank sends and sees while one variant trains; the loops call it, it changes nothing.

    ``grads``: DDP's gradient all-reduces (its counting comm hook's state); ``averages``: LocalSGD's
    parameter all-reduces in ``local_sgd.step()``; ``on_exit``: the average LocalSGD makes on leaving
    its block. ``eval_batch`` None: no validation loss (the K=1 check).
    """

    eval_batch: dict | None = None
    eval_every: int = 8  # micro-batches between evaluations (only where the replicas are in sync)
    grads: CommLog = field(default_factory=CommLog)
    averages: CommLog = field(default_factory=CommLog)
    on_exit: CommLog = field(default_factory=CommLog)
    curve: list[dict] = field(default_factory=list)  # validation loss and bytes sent so far
    drift: list[dict] = field(default_factory=list)  # LocalSGD: the replicas' distance per step
    step_calls: list[int] = field(default_factory=list)  # all-reduce calls in each micro-step
    optimizer_steps: int = 0
    anchor: torch.Tensor | None = None  # the parameters at the last average (LocalSGD)

    @property
    def calls(self) -> int:
        """All-reduce calls in the loop: gradients and parameter averages."""
        return self.grads.calls + self.averages.calls

    @property
    def bytes(self) -> int:
        """Bytes handed to all-reduce in the loop (the average on leaving LocalSGD's block not counted)."""
        return self.grads.bytes + self.averages.bytes

    def start(self, model: torch.nn.Module) -> None:
        """Before the first step: the anchor of the drift, and the validation loss at the start."""
        self.anchor = flat_params(model)
        if self.eval_batch is not None:
            self.curve.append(
                {"step": 0, "bytes": 0, "val_loss": mean_loss_over_ranks(model, self.eval_batch)}
            )

    def replicas(self, model: torch.nn.Module) -> dict[str, float]:
        """How far the replicas are apart now, and rank 0's move since the last average."""
        return replica_drift(model, self.anchor)

    def step(
        self, model: torch.nn.Module, step: int, *, updated: bool, in_sync: bool, before: dict | None = None
    ) -> None:
        """After micro-batch ``step``: ``updated`` (the optimizer stepped), ``in_sync`` (the replicas agree
        again: DDP's all-reduce, or LocalSGD's average), ``before`` (LocalSGD: ``replicas`` before
        ``local_sgd.step()``)."""
        self.optimizer_steps += updated
        if before is not None:
            after = replica_drift(model, self.anchor)["distance"]
            self.drift.append(
                {"step": step, "before": before["distance"], "after": after}
                | {"moved": before["moved"], "cosine": before["cosine"]}
            )
            if in_sync:
                self.anchor = flat_params(model)
        self.step_calls.append(self.calls - sum(self.step_calls))
        if in_sync and step % self.eval_every == 0 and self.eval_batch is not None:
            loss = mean_loss_over_ranks(model, self.eval_batch)
            self.curve.append({"step": step, "bytes": self.bytes, "val_loss": loss})

    def result(self, variant, model: torch.nn.Module) -> dict:
        """The record a launch returns for ``variant`` (an ``apparatus.local_sgd.Variant``)."""
        params = list(model.parameters())
        local = variant.sync == "local_sgd"
        return {
            "rank": dist.get_rank(),
            "name": variant.name,
            "sync": variant.sync,
            "every": variant.every,
            "hook": "-" if local else variant.hook,
            "micro_steps": len(self.step_calls),
            "optimizer_steps": self.optimizer_steps,
            "calls": self.calls,
            "step_calls": self.step_calls,
            "bytes": self.bytes,
            "dtypes": sorted(self.grads.dtypes | self.averages.dtypes),
            "exit_calls": self.on_exit.calls,
            "exit_bytes": self.on_exit.bytes,
            "grad_calls": self.grads.calls,  # gradient all-reduces inside DDP (0 under LocalSGD)
            "total_calls": self.calls + self.on_exit.calls,
            "total_bytes": self.bytes + self.on_exit.bytes,  # everything this rank sent, the exit too
            "parameters": sum(p.numel() for p in params),
            "parameter_tensors": len(params),
            "curve": self.curve,
            "drift": self.drift,
            "same_at_end": same_on_all_ranks(flat_params(model)),
        }


def count_rows(runs: Sequence[dict]) -> list[dict]:
    """The deterministic part of each run: steps, all-reduce calls and bytes (in the loop, on leaving
    LocalSGD's block, in total), per micro-batch, and how many times less than ``runs[0]`` in total
    (the dtypes are not in it: which 16-bit format DDP accepts depends on the build)."""
    reference = runs[0]["total_bytes"]
    return [
        {
            "variant": r["name"],
            "micro-batches": r["micro_steps"],
            "optimizer steps": r["optimizer_steps"],
            "all-reduce calls": r["total_calls"],
            "MiB in loop": round(r["bytes"] / MIB, 2),
            "MiB on exit": round(r["exit_bytes"] / MIB, 2),
            "MiB total": round(r["total_bytes"] / MIB, 2),
            "bytes/param/micro-batch": round(r["total_bytes"] / r["parameters"] / r["micro_steps"], 3),
            f"x less than {runs[0]['name']}": round(reference / r["total_bytes"], 1)
            if r["total_bytes"]
            else "-",
        }
        for r in runs
    ]


def plot_loss_vs_bytes(runs: Sequence[dict], axes=None):
    """Validation loss against MiB sent (log scale) and against micro-batches seen, one line per variant."""
    import matplotlib.pyplot as plt

    from course_lib import plots  # noqa: F401  (Japanese labels)

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    start = runs[0]["curve"][0]["val_loss"]
    for r in runs:
        points = r["curve"][1:]  # the start (0 bytes) cannot sit on a log axis
        axes[0].plot(
            [p["bytes"] / MIB for p in points], [p["val_loss"] for p in points], "o-", label=r["name"]
        )
        axes[1].plot(
            [p["step"] for p in r["curve"]], [p["val_loss"] for p in r["curve"]], "o-", label=r["name"]
        )
    for ax in axes:
        ax.axhline(start, color="gray", linestyle=":", linewidth=1, label="開始時")
        ax.set_ylabel("検証損失")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("1 ランクが all-reduce に渡した MiB（対数目盛）")
    axes[1].set_xlabel("1 ランクが見たマイクロバッチの数")
    axes[0].set_title("通信量に対する損失"), axes[1].set_title("見たデータに対する損失")
    axes[1].legend(fontsize=8)
    plt.tight_layout()
    return axes


def drift_series(drift: Sequence[dict]) -> tuple[list[float], list[float]]:
    """A saw-tooth for plotting: x and y of the distance after each step, dropping at each averaging."""
    xs, ys = [0.0], [0.0]
    for d in drift:
        xs.append(d["step"])
        ys.append(d["before"])
        if not math.isclose(d["before"], d["after"]):
            xs.append(d["step"])
            ys.append(d["after"])
    return xs, ys


def plot_drift(runs: Sequence[dict], ax=None):
    """Distance between the two replicas' parameters over the local steps of each LocalSGD run."""
    import matplotlib.pyplot as plt

    from course_lib import plots  # noqa: F401  (Japanese labels)

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    for r in runs:
        if r["drift"]:
            ax.plot(*drift_series(r["drift"]), label=r["name"])
    ax.set_xlabel("ローカルステップ")
    ax.set_ylabel("ランク 0 と 1 の L2 距離")
    ax.set_title("平均と平均の間でレプリカが離れ、平均で 0 に戻る")
    ax.legend(fontsize=8)
    return ax


def plot_sync_timeline(variants: Sequence, steps: int, ax=None):
    """When each variant (``apparatus.local_sgd.Variant``) all-reduces over ``steps`` micro-batches, and
    how many bytes per parameter: gradients (DDP, accumulation), parameters (LocalSGD, every ``every``
    steps and once more on leaving its block). Drawn from the settings alone: nothing is run."""
    import matplotlib.pyplot as plt

    from course_lib import plots  # noqa: F401  (Japanese labels)

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * len(variants) + 1.2), layout="constrained")
    kinds = {"grads": ("C0", "勾配の all-reduce"), "params": ("C1", "パラメーターの平均")}
    shown = set()
    for row, v in enumerate(variants):
        width = 4 if v.hook == "fp32" else 2  # bytes per element on the wire
        kind = "params" if v.sync == "local_sgd" else "grads"
        at = [s for s in range(1, steps + 1) if s % v.every == 0] + (
            [steps + 2.5] if kind == "params" else []
        )  # on leaving the block
        color, label = kinds[kind]
        y = len(variants) - 1 - row
        ax.bar(
            at, 0.2 * width, bottom=y - 0.4, width=0.7, color=color, label=None if kind in shown else label
        )
        shown.add(kind)
        ax.text(steps + 4, y, f"{len(at) * width} B/パラメーター", va="center", fontsize=9)
    ax.set_yticks(range(len(variants)), [v.name for v in reversed(variants)])
    ax.set_xlim(0, steps + 12)
    ax.set_ylim(-0.6, len(variants) - 0.2)
    ticks = [1, *range(4, steps + 1, 4)]
    ax.set_xticks([*ticks, steps + 2.5], [*map(str, ticks), "終了時"])
    ax.set_xlabel("マイクロバッチ（ステップ）。棒の高さ = 1 要素のバイト数（4 か 2）、右端 = 合計")
    ax.set_title("いつ、何を送るか: DDP は毎ステップ、ローカル SGD は K ステップに 1 回")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax
