"""course_lib.apparatus.local_sgd: lesson 05's loops (DDP with no_sync, LocalSGD), the bf16-hook checks,
and its two-rank launch.

The fast tests run in this process, in a one-process gloo group (a FileStore: no network). The
two-process tests are in the slow tier.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.apparatus import local_sgd as L
from course_lib.apparatus.local_sgd_counting import bf16_build_support, comm_bytes, comm_hook, counting_hook
from course_lib.apparatus.local_sgd_record import Recorder
from course_lib.distributed import launch


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


class _Classifier(torch.nn.Module):
    """``model(**batch).loss``, as the lesson's loops call a Hugging Face model."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x, labels):
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.net(x), labels))


def test_ddp_loop_all_reduces_only_at_the_end_of_each_accumulation_window(group):
    batches = [{"x": torch.randn(4, 16), "labels": torch.tensor([0, 1, 1, 0])} for _ in range(6)]
    sent = {}
    for accumulate in (1, 3):
        model = DistributedDataParallel(_Classifier())
        rec = Recorder(batches[0], eval_every=3)
        model.register_comm_hook(rec.grads, counting_hook(comm_hook("fp32")))
        rec.start(model)
        L.ddp_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, accumulate, rec)
        sent[accumulate] = rec
    n = sum(p.numel() for p in _net().parameters())
    assert sent[1].optimizer_steps == 6 and sent[1].bytes == comm_bytes(n, 4, 6)
    assert sent[3].optimizer_steps == 2 and sent[3].bytes == comm_bytes(n, 4, 6, sync_every=3)
    assert [bool(c) for c in sent[3].step_calls] == [False, False, True, False, False, True]  # no_sync
    assert [p["step"] for p in sent[3].curve] == [0, 3, 6]


def test_accumulating_in_ddp_loop_steps_on_the_windows_mean_gradient(group):
    """k micro-batches of no_sync with loss / k: the same step as one batch of all their rows."""
    torch.manual_seed(1)
    rows = {"x": torch.randn(6, 16), "labels": torch.tensor([0, 1, 1, 0, 1, 0])}
    halves = [{k: v[:3] for k, v in rows.items()}, {k: v[3:] for k, v in rows.items()}]
    after = []
    for batches, accumulate in ((halves, 2), ([rows], 1)):
        model = DistributedDataParallel(_Classifier())
        L.ddp_loop(model, torch.optim.SGD(model.parameters(), lr=0.5), batches, accumulate, Recorder())
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(after[0], after[1])


def test_bf16_hook_is_refused_exactly_where_the_build_check_says(group):
    verdict, build = L.bf16_hook_check(), bf16_build_support()
    assert (verdict == "ok") == build["accepts"]
    if not build["accepts"]:  # this course's CPU wheel
        assert verdict.startswith("TypeError") and "NCCL" in verdict


def test_the_bf16_hook_check_reads_the_build_not_the_backend(group, monkeypatch):
    """A build that reports CUDA and NCCL 2.10+ gets bf16_compress_hook registered under gloo, and it runs."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert dist.get_backend() == "gloo" and bf16_build_support()["accepts"]
    assert L.bf16_hook_check() == "ok"
    model = DistributedDataParallel(_net())
    model.register_comm_hook(None, comm_hook("bf16"))
    model(torch.randn(4, 16)).sum().backward()  # gloo all-reduces the bf16 bucket
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert L.bf16_all_reduce_check()


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="Unknown sync"):
        L.Variant("x", sync="gossip")
    with pytest.raises(ValueError, match="not a multiple"):
        L.SyncDemo(variants=(L.Variant("x", "local_sgd", 3),), steps=8)


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
    assert runs["DDP"]["bytes"] == comm_bytes(n, 4, 4)
    assert runs["accum"]["bytes"] == comm_bytes(n, 4, 4, 2) and runs["accum"]["optimizer_steps"] == 2
    assert runs["local"]["bytes"] == comm_bytes(n, 4, 4, 2)
    assert runs["local"]["calls"] == 2 * runs["local"]["parameter_tensors"]  # one all-reduce per tensor
    assert runs["local"]["exit_bytes"] == comm_bytes(n, 4, 1)  # LocalSGD averages again on exit
    assert runs["fp16"]["bytes"] == comm_bytes(n, 2, 4) and runs["fp16"]["dtypes"] == ["float16"]
    assert all(r["same_at_end"] for r in runs.values())
    drift = runs["local"]["drift"]
    assert drift[0]["before"] > 0 and drift[0]["after"] == drift[0]["before"]  # step 1: no averaging
    assert drift[1]["before"] > 0 and drift[1]["after"] == 0.0  # step 2: averaged, identical
    assert all(d["moved"] > 0 and -1.0 <= d["cosine"] <= 1.0 for d in drift)
    assert [p["step"] for p in runs["local"]["curve"]] == [0, 2, 4]
    for a, b in zip(ranks[0]["runs"], ranks[1]["runs"]):
        assert (a["calls"], a["bytes"]) == (b["calls"], b["bytes"])
        assert a["curve"] == b["curve"]  # the validation loss is gathered from both ranks


@pytest.mark.slow  # two real processes
def test_two_ranks_local_sgd_sends_no_gradients_and_k1_equals_ddp_only_with_sgd():
    ranks, runs, n = _two_ranks(L.Variant("DDP"), L.Variant("local", "local_sgd", 2), k1_steps=2)
    assert runs["DDP"]["grad_calls"] == runs["DDP"]["calls"] > 0  # the hook does see DDP's all-reduces
    assert runs["local"]["grad_calls"] == 0  # ... and none inside LocalSGD's no_sync
    assert runs["local"]["total_bytes"] == comm_bytes(n, 4, 4, 2) + comm_bytes(n, 4, 1)
    assert runs["local"]["total_calls"] == 3 * runs["local"]["parameter_tensors"]  # 2 averagings + exit
    k1 = ranks[0]["k1"]
    torch.testing.assert_close(k1["local_sgd sgd"], k1["ddp sgd"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(k1["local_sgd adamw"], k1["ddp adamw"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(k1["ddp sgd"], k1["ddp adamw"])  # both really trained
    for a, b in zip(ranks[0]["k1"].values(), ranks[1]["k1"].values()):
        assert torch.equal(a, b)  # every variant leaves the replicas identical
    assert [r["bf16_hook"] == "ok" for r in ranks] == [r["bf16_build"]["accepts"] for r in ranks]
    assert all(r["bf16_all_reduce"] for r in ranks)
