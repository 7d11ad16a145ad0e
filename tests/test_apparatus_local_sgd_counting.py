"""course_lib.apparatus.local_sgd_counting: counting what goes to the network, the bytes a strategy
should send, local SGD's averaging in one process, and what DDP's bf16-hook check reads.

All in this process, in a one-process gloo group (a FileStore: no network).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from course_lib.apparatus import local_sgd_counting as C


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- arithmetic and averaging ------------------------------------------------------------------


def test_comm_bytes_is_params_times_width_times_syncs():
    assert C.comm_bytes(1000, 4, 32) == 128_000
    assert C.comm_bytes(1000, 4, 32, sync_every=4) == 32_000
    assert C.comm_bytes(1000, 2, 32) == 64_000
    assert C.comm_bytes(1000, 4, 10, sync_every=4) == 8_000  # two syncs in 10 steps
    assert C.comm_bytes(1000, 4, 3, sync_every=4) == 0
    with pytest.raises(ValueError, match="sync_every >= 1"):
        C.comm_bytes(1000, 4, 8, sync_every=0)


def test_average_parameters_sets_every_replica_to_the_mean_and_keeps_them_independent():
    models = [_net() for _ in range(3)]
    with torch.no_grad():
        for i, m in enumerate(models):
            for p in m.parameters():
                p.add_(float(i))  # replica i = base + i
    base = _net()
    C.average_parameters(models)
    for m in models:
        for p, b in zip(m.parameters(), base.parameters()):
            torch.testing.assert_close(p, b + 1.0)  # mean of +0, +1, +2
    with torch.no_grad():
        next(models[0].parameters()).add_(5.0)
    assert not torch.equal(next(models[0].parameters()), next(models[1].parameters()))


# --- counting all-reduce -----------------------------------------------------------------------


def test_comm_log_counts_payload_bytes_by_dtype():
    log = C.CommLog()
    log.record(torch.zeros(10))
    log.record(torch.zeros(10, dtype=torch.float16))
    assert (log.calls, log.bytes, log.dtypes) == (2, 60, {"float32", "float16"})


def test_counting_all_reduce_counts_into_the_innermost_log_and_restores(group):
    real = dist.all_reduce
    outer, inner = C.CommLog(), C.CommLog()
    with C.counting_all_reduce(outer):
        dist.all_reduce(torch.ones(4))
        with C.counting_all_reduce(inner):
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
        log = C.CommLog()
        model.register_comm_hook(log, C.counting_hook(C.comm_hook(name)))
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
    model.register_comm_hook(C.CommLog(), C.counting_hook(default_hooks.allreduce_hook))
    x = torch.randn(4, 16)
    model(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # one rank: the average is the local gradient


def test_comm_log_reads_the_all_reduces_of_the_one_counter(group):
    log = C.CommLog()
    with C.counting_all_reduce(log):
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(8), src=0)  # counted by instruments.comm as a broadcast, not here
    assert (log.calls, log.bytes) == (1, 16)
    assert log.collectives.calls["broadcast"] == 1


# --- hook names and the bf16 build check ---------------------------------------------------------


def test_hook_names_are_the_training_loops_with_none_shown_as_fp32():
    from course_lib.training.ddp import COMM_HOOKS

    assert C.HOOKS == tuple("fp32" if name == "none" else name for name in COMM_HOOKS)
    assert C.comm_hook("fp32") is default_hooks.allreduce_hook  # the all-reduce DDP makes, seen from Python
    assert C.comm_hook("fp16") is default_hooks.fp16_compress_hook
    assert C.comm_hook("bf16") is default_hooks.bf16_compress_hook
    with pytest.raises(ValueError, match="Unknown hook"):
        C.comm_hook("int8")


def test_bf16_build_support_accepts_cuda_with_nccl_2_10_or_newer(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    assert not C.bf16_build_support()["accepts"]  # a CPU-only build, whatever NCCL says
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 9, 9))
    assert not C.bf16_build_support()["accepts"]  # NCCL older than 2.10
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert C.bf16_build_support() == {
        "torch.version.cuda": "12.4",
        "torch.version.hip": None,
        "NCCL": "2.21.5",
        "XPU + XCCL": False,
        "accepts": True,
    }
