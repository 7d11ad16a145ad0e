import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from course_lib import plots  # noqa: E402
from course_lib.training import History  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _history(losses, accs):
    evals = [{"step": 10 * (i + 1), "accuracy": a, "f1": a, "loss": 1 - a} for i, a in enumerate(accs)]
    return History(config={}, losses=list(losses), evals=evals)


def test_moving_average_is_a_trailing_mean():
    assert plots.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plots.moving_average([2.0, 4.0], 1) == [2.0, 4.0]
    with pytest.raises(ValueError, match="window"):
        plots.moving_average([1.0], 0)


def test_plot_losses_accepts_histories_and_plain_lists():
    ax = plots.plot_losses({"a": _history([3.0, 2.0, 1.0], [0.5]), "b": [4.0, 3.5]})
    assert isinstance(ax, Axes)
    lines = ax.get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[3.0, 2.0, 1.0], [4.0, 3.5]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]


def test_plot_losses_smoothing_draws_raw_and_smoothed_curves():
    ax = plots.plot_losses({"a": [1.0, 3.0, 5.0]}, smooth=2)
    raw, smoothed = ax.get_lines()
    assert list(raw.get_ydata()) == [1.0, 3.0, 5.0]
    assert list(smoothed.get_ydata()) == [1.0, 2.0, 4.0]
    assert raw.get_color() == smoothed.get_color()


def test_plot_losses_rejects_empty_and_wrong_input():
    with pytest.raises(ValueError, match="No runs"):
        plots.plot_losses({})
    with pytest.raises(TypeError, match="History or a sequence"):
        plots.plot_losses({"a": 3.0})


def test_plot_evals_draws_metric_per_epoch_and_baseline():
    ax = plots.plot_evals({"pre": _history([1.0], [0.7, 0.8])}, baseline=0.664)
    curve, base = ax.get_lines()
    assert list(curve.get_xdata()) == [10, 20] and list(curve.get_ydata()) == [0.7, 0.8]
    assert list(base.get_ydata()) == [0.664, 0.664]
    assert "0.664" in ax.get_legend().get_texts()[1].get_text()
    with pytest.raises(KeyError, match="available"):
        plots.plot_evals({"pre": _history([1.0], [0.7])}, metric="bleu")
    with pytest.raises(ValueError, match="no evaluations"):
        plots.plot_evals({"pre": History(config={}, losses=[1.0])})


def test_plot_comparison_returns_a_two_panel_figure():
    fig = plots.plot_comparison({"a": _history([2.0, 1.0], [0.6]), "b": _history([2.0, 1.5], [0.5])}, 0.55)
    assert isinstance(fig, Figure) and len(fig.axes) == 2


def test_bar_chart_flat_values_are_labelled():
    ax = plots.bar_chart({"fp32": 170.0, "bf16": 410.0, "fp16": 0.4}, ylabel="GFLOP/s", log=True)
    heights = [p.get_height() for p in ax.patches]
    assert heights == [170.0, 410.0, 0.4]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fp32", "bf16", "fp16"]
    assert ax.get_legend() is None
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["170", "410", "0.4"]


def test_bar_chart_grouped_with_missing_value():
    values = {"cpu": {"fp32": 1.0, "bf16": 2.0}, "cuda": {"fp32": 30.0}}
    ax = plots.bar_chart(values, ylabel="GFLOP/s")
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1.0, 30.0, 2.0, 0]  # series by series: fp32 (cpu, cuda), bf16 (cpu, cuda)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fp32", "bf16"]
    assert "n/a" in [t.get_text() for t in ax.texts]


def test_bar_chart_accepts_pairs_and_rejects_bad_input():
    ax = plots.bar_chart([("a", 1.0), ("b", 2.0)], ylabel="s")
    assert [p.get_height() for p in ax.patches] == [1.0, 2.0]
    with pytest.raises(ValueError, match="Nothing to plot"):
        plots.bar_chart({}, ylabel="s")
    with pytest.raises(ValueError, match="positive"):
        plots.bar_chart({"a": 0.0}, ylabel="s", log=True)
    with pytest.raises(TypeError, match="pairs"):
        plots.bar_chart([1.0, 2.0], ylabel="s")


def test_bar_chart_draws_on_a_given_axes():
    _, ax = plt.subplots()
    assert plots.bar_chart({"a": math.pi}, ylabel="x", ax=ax) is ax


def test_bar_chart_log_auto_only_for_wide_ranges():
    assert plots.bar_chart({"a": 100.0, "b": 50.0}, ylabel="x", log="auto").get_yscale() == "linear"
    assert plots.bar_chart({"a": 170.0, "b": 0.4}, ylabel="x", log="auto").get_yscale() == "log"
    with pytest.raises(ValueError, match="'auto'"):
        plots.bar_chart({"a": 1.0}, ylabel="x", log="yes")


def test_score_limits_keep_small_gaps_in_proportion():
    lo, hi = plots.score_limits([0.664, 0.672])
    assert hi - lo == pytest.approx(0.2) and lo < 0.664 and hi > 0.672
    assert plots.score_limits([0.99, 1.0]) == (pytest.approx(0.8), 1.0)
    assert plots.score_limits([0.0, 0.01]) == (0.0, pytest.approx(0.2))
    assert plots.score_limits([0.1, 0.9]) == (pytest.approx(0.08), pytest.approx(0.92))
