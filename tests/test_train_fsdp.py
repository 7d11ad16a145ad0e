"""``python -m course_lib.cli.train --fsdp``: FSDP2 on two gloo processes, against DDP, and resumed;
``TrainConfig(fsdp=True)``'s checks and ``training.fsdp``'s refusals in one process."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_train_cli import DDP_STEPS, _assert_resumed, _assert_same_params, _final_params, _metrics, _ok, _run

from course_lib import checkpoints, models
from course_lib.training import TrainConfig, fsdp
from course_lib.training.ddp import sync_gradients

# Measured (torch 2.13 CPU, gloo, 2 processes, 4 steps of AdamW, fused kernel in both runs): FSDP's final
# parameters equal DDP's bit for bit. Different reduction orders (reduce-scatter per block vs DDP's
# bucketed all-reduce) may round differently on other CPUs, so a few float32 ulps are allowed: 1e-6
# absolute is 1/50 of the smallest AdamW update of this run (lr 5e-4 x warm-up 1/2 x |update| ~ 1e-4),
# and the test checks that the steps moved the parameters by far more than that.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# The session's DDP run's flags (ddp_run): clipping is active, so the clipped update needs the global norm.
STEPS = DDP_STEPS


class _One:
    """What ``load_checkpoint`` reads of an Accelerator, for one process."""

    process_index, num_processes, scaler = 0, 1, None


@pytest.mark.slow  # two launches of two processes (about 10 s each), and the session's DDP run
def test_fsdp_on_two_gloo_processes_shards_matches_ddp_and_resumes(ddp_run, tmp_path):
    """Each rank holds half the parameters; the gradient norms (clipping) and final parameters equal
    DDP's within TOLERANCE, with accumulation; a run resumed from the FSDP run's step-2 checkpoint
    (full state dicts) ends on the FSDP run's parameters."""
    (_, ddp), sharded, resumed = ddp_run, tmp_path / "fsdp", tmp_path / "resumed"
    proc = _run([*STEPS, "--fsdp", "--output-dir", str(sharded)], tmp_path, processes=2)
    _ok(proc)
    m_ddp, m_fsdp = _metrics(ddp), _metrics(sharded)
    assert m_fsdp["config"]["fsdp"] and m_fsdp["processes"] == 2 and m_fsdp["backend"] == "gloo"
    held, total = m_fsdp["parameters_per_process"], m_fsdp["parameters"]
    print(f"parameters {total}, held per rank under FSDP {held}, under DDP {m_ddp['parameters_per_process']}")
    assert m_ddp["parameters_per_process"] == [total, total]  # DDP: a full replica on each rank
    assert sum(held) >= total and all(abs(h - total / 2) <= 0.01 * total for h in held)  # half each
    assert len(m_fsdp["grad_norms"]) == 4 and all(n > 0.1 for n in m_fsdp["grad_norms"])  # clipped
    assert m_fsdp["grad_norms"] == pytest.approx(m_ddp["grad_norms"], rel=1e-5)  # the global norm
    assert m_fsdp["losses"] == pytest.approx(m_ddp["losses"], rel=1e-5)
    final = _final_params(sharded)
    _assert_same_params(_final_params(ddp), final, **TOLERANCE)
    step2 = load_file(str(sharded / "checkpoint-000002" / "model.safetensors"))
    moved = max((final[k] - step2[k]).abs().max().item() for k in final)
    assert moved > 100 * TOLERANCE["atol"], "the last two steps barely moved: the comparison proves nothing"
    assert (
        models.load_model(str(sharded / "final")).classifier.weight.shape == final["classifier.weight"].shape
    )

    checkpoint = sharded / "checkpoint-000002"
    with pytest.raises(ValueError, match="resume it with --fsdp"):  # the full state, by name
        checkpoints.load_checkpoint(
            checkpoint, models.load_model(), torch.optim.AdamW([torch.zeros(1)]), _One()
        )
    proc = _run([*STEPS, "--fsdp", "--output-dir", str(resumed), "--resume", str(checkpoint)], tmp_path, 2)
    _assert_resumed(proc, resumed, m_fsdp, checkpoint, start=2, steps=4)
    _assert_same_params(final, _final_params(resumed), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fsdp": True, "local_sgd_steps": 2}, "use fsdp or those, not both"),
        ({"fsdp": True, "comm_hook": "fp16"}, "use fsdp or those, not both"),
        ({"fsdp": True, "optimizer": "adamw8bit"}, "optimizer adamw only"),
    ],
)
def test_train_config_refuses_fsdp_with_what_it_cannot_combine(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_shard_model_needs_a_process_group_and_no_optimizer_yet():
    model = models.load_model()
    assert fsdp.shard_model(model, enabled=False) is model and not fsdp.is_sharded(model)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node N"):
        fsdp.shard_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=Path(tmp, "store").as_uri(), rank=0, world_size=1)
        try:
            optimizer = torch.optim.AdamW(model.parameters())
            with pytest.raises(ValueError, match="shard_model\\(model\\) first, then build the optimizer"):
                fsdp.shard_model(model, optimizer=optimizer)
            fsdp.shard_model(model)
            assert fsdp.is_sharded(model) and fsdp.local_numel(model) == sum(
                p.numel() for p in model.parameters()
            )
            assert len(fsdp.transformer_blocks(model)) == len(model.distilbert.transformer.layer)
            assert fsdp.is_sharded(model.distilbert.transformer.layer[0])  # each block, then the root
            groups = [
                g
                for m in model.modules()
                if fsdp.is_sharded(m)
                for g in m._get_fsdp_state()._fsdp_param_groups
            ]
            with sync_gradients(model, update=False):  # accumulation: no reduce-scatter mid-window
                assert not any(g.reduce_grads for g in groups)
            assert (
                all(g.reduce_grads for g in groups)
                and len(groups) == len(model.distilbert.transformer.layer) + 1
            )
        finally:
            dist.destroy_process_group()


def test_an_fsdp_resume_refuses_a_checkpoint_without_parameter_names(tmp_path):
    with pytest.raises(ValueError, match="a run without --fsdp"):
        checkpoints._by_name({"state": {0: {}}, "param_groups": [{"params": [0]}]}, tmp_path)


def test_build_optimizer_shards_first_and_train_refuses_an_optimizer_made_before_sharding():
    """One place decides FSDP sharding: ``training.build_optimizer`` shards, then builds the optimizer
    on the shards; ``train`` given an optimizer of an unsharded model under fsdp refuses it."""
    from course_lib import training

    cfg = TrainConfig(fsdp=True, max_steps=1, progress=False, eval_every_epoch=False)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=Path(tmp, "store").as_uri(), rank=0, world_size=1)
        try:
            model = models.load_model()
            optimizer = training.build_optimizer(model, cfg)
            assert fsdp.is_sharded(model)
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            assert held == {id(p) for p in model.parameters()}  # the shards, not the replaced tensors
            plain = models.load_model()
            early = torch.optim.AdamW(plain.parameters())
            with pytest.raises(ValueError, match="build_optimizer"):
                training.train(
                    plain, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}], cfg, optimizer=early
                )
            assert not fsdp.is_sharded(plain)
        finally:
            dist.destroy_process_group()
