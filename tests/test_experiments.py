from dataclasses import asdict

import pytest

from course_lib import experiments
from course_lib.training import History

# The budget the lesson (notebooks/01) and the README table use: the defaults of ComparisonConfig.
BUDGET: dict = {}
MARGIN = 0.05  # validation accuracy points the pretrained start must win by


@pytest.fixture(scope="module")
def comparison():
    return experiments.pretrained_vs_scratch(**BUDGET, progress=False)


def test_pretrained_checkpoint_beats_random_init_on_the_same_budget(comparison):
    pre, scratch = comparison["pretrained"], comparison["scratch"]
    assert pre["accuracy"] > scratch["accuracy"] + MARGIN, experiments.markdown_table(comparison)
    assert pre["accuracy"] > comparison["majority_accuracy"] + MARGIN, experiments.markdown_table(comparison)


def test_both_runs_share_one_budget_and_record_everything():
    result = experiments.pretrained_vs_scratch(
        epochs=2, batch_size=16, train_rows=48, progress=False, eval_rows=40
    )
    assert result["config"]["train_rows"] == 48 and result["config"]["precision"] == "no"
    for run in experiments.RUNS:
        r, history = result[run], result["histories"][run]
        assert isinstance(history, History)
        assert len(r["losses"]) == 6 and len(r["evals"]) == 2  # 3 steps per epoch, one eval per epoch
        assert history.config == result["histories"]["pretrained"].config  # the same budget
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["f1"] <= 1.0 and r["seconds"] > 0
        assert r["accuracy"] == r["evals"][-1]["accuracy"]
    assert result["pretrained"]["losses"] != result["scratch"]["losses"]
    assert 0.5 <= result["majority_accuracy"] <= 1.0


def test_majority_accuracy():
    assert experiments.majority_accuracy([1, 1, 0, 1]) == 0.75
    assert experiments.majority_accuracy([0, 0, 0, 1]) == 0.75


def test_bad_budget_gets_a_clear_error():
    with pytest.raises(ValueError, match="epochs"):
        experiments.ComparisonConfig(epochs=0)
    with pytest.raises(ValueError, match="lr"):
        experiments.ComparisonConfig(lr=0)
    with pytest.raises(ValueError, match="precision"):
        experiments.ComparisonConfig(precision="fp8")
    assert experiments.ComparisonConfig(precision="fp32").precision == "no"


def test_markdown_table_lists_both_runs_and_the_baseline():
    run = {"accuracy": 0.8125, "f1": 0.85, "eval_loss": 0.4, "seconds": 12.3}
    result = {
        "config": asdict(experiments.ComparisonConfig()),
        "pretrained": run,
        "scratch": {**run, "accuracy": 0.664},
        "majority_accuracy": 0.664,
    }
    lines = experiments.markdown_table(result).splitlines()
    assert lines[0].startswith("| start from | val accuracy |")
    assert lines[2] == "| pretrained checkpoint | 0.812 | 0.850 | 0.400 | 12 |"
    assert lines[3].startswith("| random init | 0.664 |")
    assert lines[4].startswith("| (always the majority class) | 0.664 |")
    assert "Same budget for both" in lines[-1]


def test_cli_prints_a_table_and_rejects_bad_input(capsys):
    argv = ["--epochs", "1", "--batch-size", "16", "--train-rows", "16", "--no-progress"]
    assert experiments.main(argv) == 0
    out = capsys.readouterr().out
    assert "| pretrained checkpoint |" in out and "| random init |" in out
    assert experiments.main(["--precision", "fp8", "--no-progress"]) == 2
    assert "Unknown precision" in capsys.readouterr().err
