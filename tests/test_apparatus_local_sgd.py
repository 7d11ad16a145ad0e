"""course_lib.apparatus.local_sgd: counting what goes to the network, local SGD's averaging, lesson 05's launch.

The fast tests run in this process, in a one-process gloo group (a FileStore: no network). The
two-process test (``test_two_ranks_count_and_drift``) is in the slow tier.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from course_lib.apparatus import local_sgd as L
from course_lib.distributed import launch


@pytest.fixture
def group(tmp_path):
    """A one-process gloo process group for the test, destroyed afterwards."""
    assert not dist.is_initialized(), "an earlier test left its process group behind: destroy it in a finally"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- arithmetic and averaging ------------------------------------------------------------------


def test_comm_bytes_is_params_times_width_times_syncs():
    assert L.comm_bytes(1000, 4, 32) == 128_000
    assert L.comm_bytes(1000, 4, 32, sync_every=4) == 32_000
    assert L.comm_bytes(1000, 2, 32) == 64_000
    assert L.comm_bytes(1000, 4, 10, sync_every=4) == 8_000  # two syncs in 10 steps
    assert L.comm_bytes(1000, 4, 3, sync_every=4) == 0
    with pytest.raises(ValueError, match="sync_every >= 1"):
        L.comm_bytes(1000, 4, 8, sync_every=0)


def test_average_parameters_sets_every_replica_to_the_mean_and_keeps_them_independent():
    models = [_net() for _ in range(3)]
    with torch.no_grad():
        for i, m in enumerate(models):
            for p in m.parameters():
                p.add_(float(i))  # replica i = base + i
    base = _net()
    L.average_parameters(models)
    for m in models:
        for p, b in zip(m.parameters(), base.parameters()):
            torch.testing.assert_close(p, b + 1.0)  # mean of +0, +1, +2
    with torch.no_grad():
        next(models[0].parameters()).add_(5.0)
    assert not torch.equal(next(models[0].parameters()), next(models[1].parameters()))


# --- counting all-reduce -----------------------------------------------------------------------


def test_comm_log_counts_payload_bytes_by_dtype():
    log = L.CommLog()
    log.record(torch.zeros(10))
    log.record(torch.zeros(10, dtype=torch.float16))
    assert (log.calls, log.bytes, log.dtypes) == (2, 60, {"float32", "float16"})


def test_counting_all_reduce_counts_into_the_innermost_log_and_restores(group):
    real = dist.all_reduce
    outer, inner = L.CommLog(), L.CommLog()
    with L.counting_all_reduce(outer):
        dist.all_reduce(torch.ones(4))
        with L.counting_all_reduce(inner):
            dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.ones(2, dtype=torch.float16))
    dist.all_reduce(torch.ones(100))  # outside: not counted
    assert (outer.calls, outer.bytes) == (2, 16 + 4)
    assert (inner.calls, inner.bytes) == (1, 32)
    assert dist.all_reduce is real


def test_counting_hook_counts_what_ddp_sends_fp32_then_half_with_fp16(group):
    sent = {}
    for name in ("fp32", "fp16"):
        model = DistributedDataParallel(_net())
        log = L.CommLog()
        model.register_comm_hook(log, L.counting_hook(L.comm_hook(name)))
        for _ in range(3):
            model(torch.randn(4, 16)).sum().backward()
        sent[name] = log
    n = _params(_net())
    assert sent["fp32"].bytes == 3 * 4 * n and sent["fp32"].dtypes == {"float32"}
    assert sent["fp16"].bytes == 3 * 2 * n and sent["fp16"].dtypes == {"float16"}
    assert sent["fp32"].calls == sent["fp16"].calls >= 3


def test_counting_hook_keeps_ddp_gradients(group):
    reference = _net()
    model = DistributedDataParallel(copy.deepcopy(reference))
    model.register_comm_hook(L.CommLog(), L.counting_hook(default_hooks.allreduce_hook))
    x = torch.randn(4, 16)
    model(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # one rank: the average is the local gradient


def test_bf16_hook_is_refused_exactly_where_the_build_check_says(group):
    verdict, build = L.bf16_hook_check(), L.bf16_build_support()
    assert (verdict == "ok") == build["accepts"]
    if not build["accepts"]:  # this course's CPU wheel
        assert verdict.startswith("TypeError") and "NCCL" in verdict


def test_the_bf16_hook_check_reads_the_build_not_the_backend(group, monkeypatch):
    """A build that reports CUDA and NCCL 2.10+ gets bf16_compress_hook registered under gloo, and it runs."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert dist.get_backend() == "gloo" and L.bf16_build_support()["accepts"]
    assert L.bf16_hook_check() == "ok"
    model = DistributedDataParallel(_net())
    model.register_comm_hook(None, L.comm_hook("bf16"))
    model(torch.randn(4, 16)).sum().backward()  # gloo all-reduces the bf16 bucket
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert L.bf16_all_reduce_check()


def test_hook_names_are_the_training_loops_with_none_shown_as_fp32():
    from course_lib.training.ddp import COMM_HOOKS

    assert L.HOOKS == tuple("fp32" if name == "none" else name for name in COMM_HOOKS)
    assert L.comm_hook("fp32") is default_hooks.allreduce_hook  # the all-reduce DDP makes, seen from Python
    assert L.comm_hook("fp16") is default_hooks.fp16_compress_hook
    assert L.comm_hook("bf16") is default_hooks.bf16_compress_hook


def test_comm_log_reads_the_all_reduces_of_the_one_counter(group):
    log = L.CommLog()
    with L.counting_all_reduce(log):
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(8), src=0)  # counted by instruments.comm as a broadcast, not here
    assert (log.calls, log.bytes) == (1, 16)
    assert log.collectives.calls["broadcast"] == 1


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="Unknown hook"):
        L.comm_hook("int8")
    with pytest.raises(ValueError, match="Unknown sync"):
        L.Variant("x", sync="gossip")
    with pytest.raises(ValueError, match="not a multiple"):
        L.SyncDemo(variants=(L.Variant("x", "local_sgd", 3),), steps=8)


def test_drift_series_drops_at_each_averaging():
    drift = [
        {"step": 1, "before": 1.0, "after": 1.0},
        {"step": 2, "before": 2.0, "after": 0.0},
        {"step": 3, "before": 1.5, "after": 1.5},
    ]
    assert L.drift_series(drift) == ([0.0, 1, 2, 2, 3], [0.0, 1.0, 2.0, 0.0, 1.5])


# --- two real processes (slow tier) ------------------------------------------------------------


def _two_ranks(*variants, **settings):
    """Both ranks' reports of a tiny SyncDemo (4 steps of 2 rows), rank 0's runs by name, parameters."""
    demo = L.SyncDemo(variants=variants, steps=4, batch_size=2, eval_rows=4, eval_every=2, **settings)
    ranks = launch(L.sync_worker, 2, args=(demo,), backend="gloo")
    runs = {r["name"]: r for r in ranks[0]["runs"]}
    return ranks, runs, runs["DDP"]["parameters"]


@pytest.mark.slow  # two real processes
def test_two_ranks_count_and_drift():
    ranks, runs, n = _two_ranks(
        L.Variant("DDP"),
        L.Variant("accum", "accum", 2),
        L.Variant("local", "local_sgd", 2),
        L.Variant("fp16", hook="fp16"),
    )
    assert ranks[0]["distributed_type"].endswith("MULTI_CPU")
    assert "NCCL" in ranks[0]["bf16_hook"]
    assert runs["DDP"]["bytes"] == L.comm_bytes(n, 4, 4)
    assert runs["accum"]["bytes"] == L.comm_bytes(n, 4, 4, 2) and runs["accum"]["optimizer_steps"] == 2
    assert runs["local"]["bytes"] == L.comm_bytes(n, 4, 4, 2)
    assert runs["local"]["calls"] == 2 * runs["local"]["parameter_tensors"]  # one all-reduce per tensor
    assert runs["local"]["exit_bytes"] == L.comm_bytes(n, 4, 1)  # LocalSGD averages again on exit
    assert runs["fp16"]["bytes"] == L.comm_bytes(n, 2, 4) and runs["fp16"]["dtypes"] == ["float16"]
    assert all(r["same_at_end"] for r in runs.values())
    drift = runs["local"]["drift"]
    assert drift[0]["before"] > 0 and drift[0]["after"] == drift[0]["before"]  # step 1: no averaging
    assert drift[1]["before"] > 0 and drift[1]["after"] == 0.0  # step 2: averaged, identical
    assert all(d["moved"] > 0 and -1.0 <= d["cosine"] <= 1.0 for d in drift)
    assert [p["step"] for p in runs["local"]["curve"]] == [0, 2, 4]
    for a, b in zip(ranks[0]["runs"], ranks[1]["runs"]):
        assert (a["calls"], a["bytes"]) == (b["calls"], b["bytes"])
        assert a["curve"] == b["curve"]  # the validation loss is gathered from both ranks


def test_count_rows_adds_the_average_on_exit_to_the_total_and_the_ratio():
    runs = [
        {"name": "DDP", "micro_steps": 4, "optimizer_steps": 4, "total_calls": 8, "dtypes": ["float32"]}
        | {"bytes": 1600, "exit_bytes": 0, "total_bytes": 1600, "parameters": 100},
        {"name": "local", "micro_steps": 4, "optimizer_steps": 4, "total_calls": 6, "dtypes": ["float32"]}
        | {"bytes": 400, "exit_bytes": 400, "total_bytes": 800, "parameters": 100},
    ]
    rows = L.count_rows(runs)
    assert [r["x less than DDP"] for r in rows] == [1.0, 2.0]  # 1600 / (400 + 400), not 1600 / 400
    assert rows[1]["bytes/param/micro-batch"] == 2.0


@pytest.mark.slow  # two real processes
def test_two_ranks_local_sgd_sends_no_gradients_and_k1_equals_ddp_only_with_sgd():
    ranks, runs, n = _two_ranks(L.Variant("DDP"), L.Variant("local", "local_sgd", 2), k1_steps=2)
    assert runs["DDP"]["grad_calls"] == runs["DDP"]["calls"] > 0  # the hook does see DDP's all-reduces
    assert runs["local"]["grad_calls"] == 0  # ... and none inside LocalSGD's no_sync
    assert runs["local"]["total_bytes"] == L.comm_bytes(n, 4, 4, 2) + L.comm_bytes(n, 4, 1)
    assert runs["local"]["total_calls"] == 3 * runs["local"]["parameter_tensors"]  # 2 averagings + exit
    k1 = ranks[0]["k1"]
    torch.testing.assert_close(k1["local_sgd sgd"], k1["ddp sgd"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(k1["local_sgd adamw"], k1["ddp adamw"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(k1["ddp sgd"], k1["ddp adamw"])  # both really trained
    for a, b in zip(ranks[0]["k1"].values(), ranks[1]["k1"].values()):
        assert torch.equal(a, b)  # every variant leaves the replicas identical
    assert [r["bf16_hook"] == "ok" for r in ranks] == [r["bf16_build"]["accepts"] for r in ranks]
    assert all(r["bf16_all_reduce"] for r in ranks)
