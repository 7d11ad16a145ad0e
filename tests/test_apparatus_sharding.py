"""The sharding demo (DDP, ZeRO-1, ZeRO-2, FSDP on two gloo ranks) and the collective counter."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib import memory_model as mm
from course_lib.apparatus import sharding as sh
from course_lib.distributed import launch
from course_lib.instruments.comm import CollectiveLog, counting_collectives, ring_bytes


def test_ring_bytes():
    assert ring_bytes("all-reduce", 1000, 2) == 1000
    assert ring_bytes("all-gather", 1000, 2) + ring_bytes("reduce-scatter", 1000, 2) == 1000
    assert ring_bytes("all-reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="kind must be one of"):
        ring_bytes("gather", 1, 2)


def test_counting_collectives_in_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=Path(tmp, "store").as_uri(), rank=0, world_size=1)
        try:
            outer = CollectiveLog()
            with counting_collectives(outer), counting_collectives() as inner:
                dist.all_reduce(torch.ones(10))
                out = torch.empty(4)
                dist.all_gather_into_tensor(out, torch.ones(4))
                dist.reduce_scatter_tensor(output=torch.empty(3), input=torch.ones(3))
                dist.broadcast(torch.ones(2, dtype=torch.float64), src=0)
            dist.all_reduce(torch.ones(1))  # outside: not counted
        finally:
            dist.destroy_process_group()
    assert inner.calls == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1, "broadcast": 1}
    assert inner.bytes == {"all-reduce": 40, "all-gather": 16, "reduce-scatter": 12, "broadcast": 16}
    assert sum(outer.calls.values()) == 0  # the innermost log gets each call, once


def test_demo_rejects_bad_settings():
    with pytest.raises(ValueError, match="Unknown strategies"):
        sh.ShardDemo(strategies=("ddp", "zero4"))
    with pytest.raises(ValueError, match="rank_batches"):
        sh.shard_worker(0, 2, sh.ShardDemo(), [[]])


@pytest.fixture(scope="module")
def results():
    demo = sh.ShardDemo(steps=2, batch_size=4)
    return launch(sh.shard_worker, 2, (demo, sh.rank_batches(demo, 2)))


@pytest.mark.slow
def test_every_strategy_ends_where_ddp_ends(results):
    assert sh.agreement(results, atol=1e-5) == dict.fromkeys(sh.STRATEGIES, True)
    # each rank measured its last step's peak: at least its own gradients on top of what it held
    peaks = sh.step_peaks(results)
    grads = {r["strategy"]: r["grads"] for r in sh.bytes_rows(results)}
    assert all(peaks[name] >= grads[name] > 0 for name in sh.STRATEGIES)


@pytest.mark.slow
def test_bytes_per_rank_follow_the_stage(results):
    from course_lib.models import load_model

    arch = mm.Arch.from_config(load_model().config)
    parts = mm.predict(arch, mm.Setup(4, 32))
    rows = {(r["strategy"], r["rank"]): r for r in sh.bytes_rows(results)}
    for rank in (0, 1):
        ddp = rows["ddp", rank]
        assert (ddp["params"], ddp["grads"], ddp["optimizer state"]) == (
            parts["weights"],
            parts["gradients"],
            parts["optimizer state"],
        )
        assert rows["zero1", rank]["params"] == parts["weights"]  # ZeRO-1 keeps every parameter
        for name in ("zero1", "fsdp_no_reshard", "fsdp"):
            predicted = mm.per_rank(parts, sh.STAGE[name], 2)
            for key, part in (
                ("params", "weights"),
                ("grads", "gradients"),
                ("optimizer state", "optimizer state"),
            ):
                assert rows[name, rank][key] == pytest.approx(predicted[part], rel=0.02), (name, key)
    # DDP's all-reduce buckets hold the gradients themselves (gradient_as_bucket_view=True): no copy.
    for res in results:
        for run in res["runs"]:
            assert run["bucket_copy"] == 0, run["strategy"]
            assert run["buckets"] == (parts["gradients"] if run["strategy"] in ("ddp", "zero1") else 0)
    # The shards add up to the whole: nothing is lost or held twice.
    assert (
        rows["zero1", 0]["optimizer state"] + rows["zero1", 1]["optimizer state"] == parts["optimizer state"]
    )
    assert rows["fsdp", 0]["params"] + rows["fsdp", 1]["params"] == parts["weights"]


@pytest.mark.slow
def test_collectives_counted(results):
    comm = {r["strategy"]: r for r in sh.comm_rows(results)}
    weights = 4 * mm.Arch(1200, 128, 512, 3, 4, 128).num_params()  # the embedded model's fp32 bytes
    assert comm["ddp"]["all-reduce calls"] == 1 and comm["ddp"]["all-reduce bytes"] == weights
    assert comm["zero1"]["broadcast bytes"] == weights  # each owner broadcasts its updated parameters
    units = 3 + 1  # one FSDP unit per transformer block, one for the rest of the model
    assert comm["fsdp"]["all-gather calls"] == 2 * units and comm["fsdp"]["reduce-scatter calls"] == units
    assert comm["fsdp_no_reshard"]["all-gather calls"] == units  # parameters kept from forward to backward
    assert comm["fsdp"]["all-reduce calls"] == 0 and comm["fsdp"]["all-gather bytes"] == 2 * weights
    assert comm["fsdp_no_reshard"]["ring bytes/rank"] == comm["ddp"]["ring bytes/rank"]
    assert comm["fsdp"]["ring bytes/rank"] == pytest.approx(1.5 * comm["ddp"]["ring bytes/rank"], abs=2)


@pytest.mark.slow
def test_ddp_default_buckets_copy_the_gradients():
    """DDP's default (gradient_as_bucket_view=False) keeps one more full copy of the gradients."""
    demo = sh.ShardDemo(strategies=("ddp",), steps=2, batch_size=4, bucket_view=False)
    rows = sh.bytes_rows(launch(sh.shard_worker, 2, (demo, sh.rank_batches(demo, 2))))
    for row in rows:
        assert row["bucket copy"] == row["grads"] > 0
        assert row["total"] == row["params"] + 2 * row["grads"] + row["optimizer state"]
