"""course_lib.apparatus.local_sgd_record: what a rank records while one variant trains, and the tables
and plots the lesson reads from those records (one process: a gloo FileStore group, no network)."""

from types import SimpleNamespace

import pytest
import torch

from course_lib.apparatus import local_sgd_record as R


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, labels):
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.lin(x), labels))


def test_recorder_keeps_the_drift_moves_its_anchor_at_averages_and_evaluates_only_in_sync(group):
    torch.manual_seed(0)
    model = _Classifier()
    batch = {"x": torch.randn(4, 4), "labels": torch.tensor([0, 1, 1, 0])}
    rec = R.Recorder(batch, eval_every=2)
    rec.start(model)
    for step in range(1, 5):
        with torch.no_grad():
            model.lin.bias.add_(1.0)  # a "local step"
        before = rec.replicas(model)
        rec.averages.record(torch.zeros(3))  # what local_sgd.step() would send, on even steps only
        rec.step(model, step, updated=True, in_sync=step % 2 == 0, before=before)
    assert rec.optimizer_steps == 4
    # the move since the last average: 1, 2 (averaged: anchor moves), 1, 2 (2 bias entries: x sqrt(2))
    assert [d["moved"] ** 2 / 2 for d in rec.drift] == pytest.approx([1.0, 4.0, 1.0, 4.0])
    assert [p["step"] for p in rec.curve] == [0, 2, 4]
    assert rec.step_calls == [1, 1, 1, 1] and rec.bytes == 4 * 12
    assert [p["bytes"] for p in rec.curve] == [0, 24, 48]


def test_recorder_without_an_eval_batch_keeps_no_curve(group):
    model = _Classifier()
    rec = R.Recorder()
    rec.start(model)
    rec.step(model, 8, updated=False, in_sync=True)
    assert rec.curve == [] and rec.optimizer_steps == 0 and rec.step_calls == [0]


def test_count_rows_adds_the_average_on_exit_to_the_total_and_the_ratio():
    runs = [
        {"name": "DDP", "micro_steps": 4, "optimizer_steps": 4, "total_calls": 8, "dtypes": ["float32"]}
        | {"bytes": 1600, "exit_bytes": 0, "total_bytes": 1600, "parameters": 100},
        {"name": "local", "micro_steps": 4, "optimizer_steps": 4, "total_calls": 6, "dtypes": ["float32"]}
        | {"bytes": 400, "exit_bytes": 400, "total_bytes": 800, "parameters": 100},
    ]
    rows = R.count_rows(runs)
    assert [r["x less than DDP"] for r in rows] == [1.0, 2.0]  # 1600 / (400 + 400), not 1600 / 400
    assert rows[1]["bytes/param/micro-batch"] == 2.0


def test_drift_series_drops_at_each_averaging():
    drift = [
        {"step": 1, "before": 1.0, "after": 1.0},
        {"step": 2, "before": 2.0, "after": 0.0},
        {"step": 3, "before": 1.5, "after": 1.5},
    ]
    assert R.drift_series(drift) == ([0.0, 1, 2, 2, 3], [0.0, 1.0, 2.0, 0.0, 1.5])


def test_the_sync_timeline_draws_one_bar_per_all_reduce_and_the_total_per_parameter():
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.apparatus.local_sgd import Variant

    variants = (Variant("DDP"), Variant("local", "local_sgd", 4), Variant("half", hook="fp16"))
    ax = R.plot_sync_timeline(variants, steps=8)
    assert len(ax.patches) == 8 + (2 + 1) + 8  # every step; every 4th plus the exit; every step
    assert [t.get_text() for t in ax.texts] == ["32 B/パラメーター", "12 B/パラメーター", "16 B/パラメーター"]
