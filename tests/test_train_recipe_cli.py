"""The recipe ladder's recommended command reproduces its runs: ``python -m course_lib.cli.train`` with the
flags ``rungs.cli_flags`` prints trains the same batches with the same settings, so its losses are the
ladder's accuracy run's (slow tier: two short trainings per case)."""

import json
import math

import pytest
import torch

from course_lib.cli import train as train_cli
from course_lib.recipe_ladder import recipe, rungs, runs


@pytest.mark.slow
@pytest.mark.parametrize(
    "stack",
    [
        rungs.Stack(dynamic_padding=True, fused_adamw=True, attention="sdpa"),
        rungs.Stack(dynamic_padding=True, group_by_length=True),
    ],
    ids=["dynamic-fused-sdpa", "length-grouped"],
)
def test_the_printed_command_trains_what_the_ladder_trained(stack, tmp_path):
    cfg = recipe.RecipeConfig(batch_size=16, train_rows=64, eval_rows=32, eval_every=2, lr=1e-3)
    prepared = runs.prepare(cfg)
    ladder_run = runs.accuracy_run(stack, prepared, cfg, cfg.seed, torch.device("cpu"))
    flags = rungs.cli_flags(stack, cfg, train_rows=len(prepared.train))
    out = tmp_path / "run"
    assert train_cli.main([*flags, "--output-dir", str(out), "--no-progress", "--save-every", "1000"]) == 0
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert len(metrics["losses"]) == len(ladder_run["losses"]) == 4
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(metrics["losses"], ladder_run["losses"])), (
        metrics["losses"],
        ladder_run["losses"],
    )
