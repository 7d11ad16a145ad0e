"""Behaviours of ``course_lib.distributed`` that mutation testing found unguarded (docs/mutation.md).

Most of the module runs in launched processes, which mutmut cannot see, so everything here runs in this
process: ``launch`` with ``torch.multiprocessing.start_processes`` replaced by ``InProcessStart`` (each
"process" a thread of this one, joined by the same ``_run_rank`` over gloo and a ``FileStore``, as in a
real launch), ``join_elastic_group`` against a ``TCPStore`` standing in for torchrun's agent store, and the
replica helpers on the one-process group (the ``group`` fixture) or on two ranks in two threads
(``_on_two_ranks``, PyTorch's in-process ``threaded`` process group). A machine with GPUs is faked where
the code only asks how many there are; where a GPU would hold the tensors, the ``meta`` device stands in.
"""

import datetime
import os
import socket
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_core_fsdp import _on_two_ranks
from torch.utils.data import DistributedSampler

from course_lib import distributed as D

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _group_timeout() -> datetime.timedelta:
    """How long the default gloo group waits in a collective before it gives up."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def _fake_gpus(monkeypatch, count: int, nccl: bool = True) -> None:
    """A machine with ``count`` CUDA GPUs and a torch built with (or without) NCCL, as far as asked."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


# ----------------------------------------------------------------------------------------------
# shard_indices


@pytest.mark.parametrize("n, world_size", [(10, 4), (7, 2), (1, 3)])
def test_shard_indices_by_default_are_the_samplers_in_order_and_padded(n, world_size):
    for rank in range(world_size):
        plain = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False)
        assert D.shard_indices(n, world_size, rank) == list(plain)


def test_a_shuffled_shard_by_default_is_the_samplers_of_seed_0_and_epoch_0():
    for rank in range(3):
        sampler = DistributedSampler(range(11), num_replicas=3, rank=rank)  # seed 0, epoch 0
        assert D.shard_indices(11, 3, rank, shuffle=True) == list(sampler)


def test_no_samples_give_every_rank_nothing_and_one_sample_goes_to_every_rank():
    assert [D.shard_indices(0, 2, r) for r in range(2)] == [[], []]
    assert [D.shard_indices(1, 2, r) for r in range(2)] == [[0], [0]]


def test_drop_last_drops_nothing_when_the_samples_split_evenly():
    assert [D.shard_indices(8, 4, r, drop_last=True) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_a_number_of_samples_that_is_not_an_integer_is_refused():
    with pytest.raises(ValueError, match="non-negative number of samples, got 2.5"):
        D.shard_indices(2.5, 2, 0)


# ----------------------------------------------------------------------------------------------
# ShardedLoader


def _rows_read(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_a_default_loader_reads_every_row_once_shuffled_with_seed_0():
    loader = D.ShardedLoader(list(range(10)), batch_size=3)
    read = _rows_read(loader)
    assert [len(b) for b in read] == [3, 3, 3, 1] and len(loader) == 4
    assert sum(read, []) == D.shard_indices(10, 1, 0, shuffle=True, seed=0)
    assert sum(read, []) != list(range(10))  # shuffled


@pytest.mark.parametrize(
    "options",
    [
        {},  # shuffled, seed 0, padded
        {"shuffle": False},
        {"seed": 5},
        {"drop_last": True},
        {"shuffle": False, "drop_last": True},
    ],
)
def test_each_rank_reads_its_shard_as_shard_indices_plans_it(options):
    for rank in range(2):
        loader = D.ShardedLoader(list(range(7)), 2, world_size=2, rank=rank, **options)
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            expected = D.shard_indices(
                7,
                2,
                rank,
                shuffle=options.get("shuffle", True),
                seed=options.get("seed", 0),
                epoch=epoch,
                drop_last=options.get("drop_last", False),
            )
            if options.get("drop_last"):  # 3 rows per rank: the last, smaller batch is left out too
                expected = expected[:2]
            assert sum(_rows_read(loader), []) == expected


def test_batch_indices_are_the_rows_of_the_batches_this_rank_reads():
    loader = D.ShardedLoader(list(range(14)), 3, world_size=2, rank=1, seed=3)
    loader.sampler.set_epoch(2)
    planned = loader.batch_indices()
    assert [len(b) for b in planned] == [3, 3, 1]
    assert planned == _rows_read(loader)


def test_with_drop_last_every_batch_read_and_planned_is_full():
    loader = D.ShardedLoader(list(range(14)), 3, world_size=2, rank=1, seed=3, drop_last=True)
    loader.sampler.set_epoch(2)
    planned = loader.batch_indices()
    assert [len(b) for b in planned] == [3, 3] and len(loader) == 2
    assert planned == _rows_read(loader)


def test_the_loader_collates_with_the_function_it_is_given():
    loader = D.ShardedLoader(list(range(5)), 2, collate_fn=lambda rows: {"ids": torch.tensor(rows) * 10})
    batches = list(loader)
    assert all(set(b) == {"ids"} for b in batches)
    assert sorted(torch.cat([b["ids"] for b in batches]).tolist()) == [0, 10, 20, 30, 40]


def test_the_batches_arrive_on_the_loaders_device():
    """A GPU's place is taken by the meta device: the batches are moved there, tensors of a dict too."""
    batches = list(
        D.ShardedLoader(list(range(4)), 2, collate_fn=lambda r: {"x": torch.tensor(r)}, device="meta")
    )
    assert [b["x"].device for b in batches] == [torch.device("meta")] * 2
    assert [b.device for b in D.ShardedLoader(list(range(4)), 2)] == [torch.device("cpu")] * 2


def test_reading_the_loader_draws_nothing_from_the_global_random_generator():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    list(D.ShardedLoader(list(range(6)), 2, seed=1))
    assert torch.equal(torch.get_rng_state(), state)


def test_a_single_row_and_batches_of_one_are_accepted():
    assert _rows_read(D.ShardedLoader([7], batch_size=1)) == [[7]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 2, "rank": 2}, r"rank must be an integer in 0\.\.1 for world_size=2, got 2"),
        ({"batch_size": 0}, r"batch_size must be >= 1, got 0"),
    ],
)
def test_a_loader_refuses_a_rank_outside_the_world_and_an_empty_batch(kwargs, message):
    with pytest.raises(ValueError, match=message):
        D.ShardedLoader(list(range(4)), **{"batch_size": 2, **kwargs})


# ----------------------------------------------------------------------------------------------
# default_backend, rank_device, free_port


@pytest.mark.parametrize(
    "gpus, nccl, world_size, backend",
    [
        (1, True, None, "nccl"),  # the default: one process
        (2, True, 2, "nccl"),  # exactly one GPU per process
        (1, True, 2, "gloo"),  # fewer GPUs than processes
        (0, True, 1, "gloo"),  # NCCL built in, but no GPU
        (4, False, 2, "gloo"),  # GPUs, but a torch without NCCL
    ],
)
def test_the_default_backend_is_nccl_only_with_a_gpu_per_process_and_nccl(
    monkeypatch, gpus, nccl, world_size, backend
):
    _fake_gpus(monkeypatch, gpus, nccl)
    assert (D.default_backend() if world_size is None else D.default_backend(world_size)) == backend


def test_nccl_is_accepted_with_exactly_one_gpu_per_process(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    assert D.check_backend("nccl") == "nccl"  # one process by default
    _fake_gpus(monkeypatch, 2)
    assert D.check_backend("nccl", world_size=2) == "nccl"


def test_a_rank_computes_on_its_gpu_under_nccl_and_on_the_cpu_otherwise():
    assert D.rank_device(1, "nccl") == torch.device("cuda", 1)
    assert D.rank_device(1, "gloo") == torch.device("cpu")
    assert D.rank_device(0) == torch.device("cpu")  # no group: gloo


def test_without_a_backend_named_the_groups_backend_decides(group, monkeypatch):
    assert D.rank_device(0) == torch.device("cpu")  # a gloo group
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # an nccl group, as far as asked
    assert D.rank_device(1) == torch.device("cuda", 1)


def test_free_port_is_an_unprivileged_port_that_can_be_bound_right_away():
    port = D.free_port()
    assert isinstance(port, int) and 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


# ----------------------------------------------------------------------------------------------
# launch and _run_rank, in this process


@contextmanager
def _thread_local_groups():
    """Each thread of this process may form its own default process group (as torch's threaded tests do)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        yield
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


class InProcessStart:
    """``torch.multiprocessing.start_processes`` with each process a thread of this one: ``fn(i, *args)``
    for i in ``range(nprocs)``, each thread with its own default group; re-raises what a rank raised.
    Records each call's ``nprocs``, ``start_method`` and ``args``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        self.calls.append({"nprocs": nprocs, "start_method": start_method, "args": args})
        errors: list[BaseException] = []

        def process(i: int) -> None:
            try:
                fn(i, *args)
            except BaseException as error:
                errors.append(error)

        with _thread_local_groups():
            threads = [threading.Thread(target=process, args=(i,), daemon=True) for i in range(nprocs)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert not any(t.is_alive() for t in threads), "a rank hung"
        if errors:
            raise errors[0]


class GpuSelected(Exception):
    """Raised by the stand-in for ``torch.cuda.set_device``: a rank picked a GPU."""


@pytest.fixture
def in_process(monkeypatch):
    """``launch`` in this process (``InProcessStart``); the environment and torch's thread count are put
    back afterwards, and ``torch.cuda.set_device`` records the GPU a rank picks, then raises."""
    start = InProcessStart()
    start.gpus_selected = []

    def set_device(device):
        start.gpus_selected.append(device)
        raise GpuSelected(device)

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for name in (*ENV, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")  # recorded: restored (or removed) after the test
        monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    yield start
    torch.set_num_threads(threads)


def _report(rank: int, world_size: int, *args) -> dict:
    """A launched function: what it was called with and what it finds around it."""
    return {
        "rank": rank,
        "world_size": world_size,
        "args": args,
        "group": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "env": {name: os.environ.get(name) for name in ENV},
        "threads": torch.get_num_threads(),
        "timeout_s": _group_timeout().total_seconds(),  # a number: torch.load reads it back
    }


def _fail(rank: int, world_size: int) -> None:
    raise ArithmeticError(f"rank {rank} failed")


def test_launch_returns_what_each_rank_returned_in_rank_order(in_process):
    results = D.launch(_report, args=["a", 2], backend="gloo", timeout_s=20)  # two processes by default
    assert [r["rank"] for r in results] == [0, 1] and [r["world_size"] for r in results] == [2, 2]
    assert [r["group"] for r in results] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert [r["args"] for r in results] == [("a", 2), ("a", 2)]
    assert in_process.calls[0]["nprocs"] == 2 and in_process.gpus_selected == []


def test_a_launched_rank_finds_its_rank_in_the_environment_one_torch_thread_and_a_300_s_timeout(in_process):
    (result,) = D.launch(_report, world_size=1)
    assert result["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    assert result["threads"] == 1
    assert result["timeout_s"] == 300
    assert result["group"] == (0, 1, "gloo")


def test_a_launched_rank_gets_the_threads_and_timeout_asked_for(in_process):
    (result,) = D.launch(_report, world_size=1, backend="gloo", threads=2, timeout_s=7)
    assert result["threads"] == 2 and result["timeout_s"] == 7


def test_launch_starts_the_processes_with_the_start_method_asked_for(in_process):
    D.launch(_report, world_size=1)
    for method in ("fork", "forkserver", "spawn"):
        D.launch(_report, world_size=1, start_method=method)
    assert [c["start_method"] for c in in_process.calls] == ["spawn", "fork", "forkserver", "spawn"]


def test_a_launchs_files_live_in_a_course_launch_folder_removed_afterwards(in_process):
    D.launch(_report, world_size=1)
    out_dir = Path(in_process.calls[0]["args"][5])
    assert out_dir.name.startswith("course-launch-") and not out_dir.exists()


def test_an_error_in_a_rank_reaches_the_caller_and_leaves_no_group_behind(in_process):
    with pytest.raises(ArithmeticError, match="rank 0 failed"):
        D.launch(_fail, world_size=1)
    assert not dist.is_initialized()


def test_an_explicit_gloo_backend_is_kept_on_a_machine_with_a_gpu_per_process(in_process, monkeypatch):
    _fake_gpus(monkeypatch, 2)
    (result,) = D.launch(_report, world_size=1, backend="gloo")
    assert result["group"][2] == "gloo" and in_process.gpus_selected == []


def test_launch_refuses_nccl_for_two_processes_on_a_machine_with_one_gpu(in_process, monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="one CUDA GPU per process: 2 processes, 1 GPU"):
        D.launch(_report, world_size=2, backend="nccl")
    assert in_process.calls == []


def test_under_nccl_a_rank_picks_its_own_gpu_before_joining_the_group(in_process, tmp_path):
    with pytest.raises(GpuSelected):
        D._run_rank(1, _report, 2, "nccl", 1, 5, str(tmp_path), ())
    assert in_process.gpus_selected == [1] and not dist.is_initialized()


def test_launch_refuses_fewer_than_one_thread(in_process):
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        D.launch(_report, world_size=1, threads=0)
    assert in_process.calls == []


def test_an_unknown_start_method_is_refused_naming_the_ones_there_are(in_process):
    with pytest.raises(ValueError, match="Unknown start_method 'thread': use one of spawn, fork, forkserver"):
        D.launch(_report, world_size=1, start_method="thread")
    assert in_process.calls == []


def test_launch_runs_a_callable_that_has_no_module(in_process):
    assert D.launch(int.__add__, world_size=1) == [0 + 1]  # a slot wrapper: no __module__ to look at


def _notebook_function(rank, world_size):
    return rank


class _NotebookCallable:
    def __call__(self, rank, world_size):
        return rank

    def __repr__(self) -> str:
        return "<the notebook's callable>"


_notebook_function.__module__ = _NotebookCallable.__module__ = "__main__"  # as if defined in a notebook


def test_a_notebook_function_is_named_in_the_refusal_and_fork_accepts_it(in_process):
    with pytest.raises(ValueError, match="'_notebook_function' is defined in the notebook"):
        D.launch(_notebook_function, world_size=1, start_method="forkserver")
    with pytest.raises(ValueError, match="<the notebook's callable> is defined in the notebook"):
        D.launch(_NotebookCallable(), world_size=1)  # a callable without a __name__: its repr
    assert D.launch(_notebook_function, world_size=1, start_method="fork") == [0]


# ----------------------------------------------------------------------------------------------
# join_elastic_group


def _agent_store() -> dist.TCPStore:
    """torchrun's agent store as its workers see it: a store without a world size of its own."""
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=datetime.timedelta(seconds=30))


@contextmanager
def _destroyed_afterwards():
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_join_elastic_group_reads_torchruns_environment_and_waits_30_minutes_by_default(monkeypatch):
    agent = _agent_store()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "WORLD_SIZE": "1", "RANK": "0"}
    for name, value in {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # the first attempt
    with _destroyed_afterwards():
        assert D.join_elastic_group("gloo")
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        keys = agent.list_keys()
        assert keys and all(k.startswith("course-attempt-0/") for k in keys), keys
        assert _group_timeout() == datetime.timedelta(minutes=30)
        assert dist.distributed_c10d._get_default_store().timeout == datetime.timedelta(minutes=30)


def test_join_elastic_group_forms_the_group_with_the_backend_and_timeout_asked_for():
    agent = _agent_store()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "WORLD_SIZE": "1",
        "RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    with _destroyed_afterwards():
        assert D.join_elastic_group("gloo", env, timeout_s=45)
        assert dist.get_backend() == "gloo" and _group_timeout() == datetime.timedelta(seconds=45)
        # the store a rank waits on for its peers gives up after the same time
        assert dist.distributed_c10d._get_default_store().timeout == datetime.timedelta(seconds=45)
        assert all(k.startswith("course-attempt-2/") for k in agent.list_keys())


@pytest.mark.parametrize(
    "launch, warns",
    [
        ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "LOCAL_RANK": "0"}, True),
        ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1"}, True),  # no LOCAL_RANK: the first
        ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1", "LOCAL_RANK": "1"}, False),  # said once
        ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # nothing restarts
        ({"GROUP_WORLD_SIZE": "2"}, False),  # torchrun's default: no restarts
        ({"GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}, False),  # one node counts alike
        ({"TORCHELASTIC_MAX_RESTARTS": "3"}, False),  # no node count: one node
        # static ranks share the store whatever the variable says: set, it is not asked for again
        (
            {
                "GROUP_WORLD_SIZE": "2",
                "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            },
            False,
        ),
        (
            {
                "GROUP_WORLD_SIZE": "2",
                "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0",
            },
            True,
        ),
    ],
)
def test_several_nodes_that_may_restart_are_told_to_give_each_attempt_a_fresh_store(launch, warns):
    agent = _agent_store()
    env = _CallerSpy(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port), WORLD_SIZE="1", RANK="0")
    env.update({"TORCHELASTIC_USE_AGENT_STORE": "True", **launch})
    with _destroyed_afterwards(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert D.join_elastic_group("gloo", env)
    said = [w for w in caught if w.category is RuntimeWarning]
    assert len(said) == int(warns), [str(w.message) for w in said]
    if warns:
        nodes, restarts = launch["GROUP_WORLD_SIZE"], launch["TORCHELASTIC_MAX_RESTARTS"]
        assert str(said[0].message) == (  # what a node's log says, whole: the cause and what to do
            f"torchrun: {nodes} nodes with --max-restarts {restarts} share one rendezvous store across "
            "restarts, and under --rdzv-backend c10d each node counts its own attempts: a restarted group "
            "can fail in 'Gloo connectFullMesh failed ... Connection refused' (pytorch/pytorch#135712). Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (docs/distributed.md); with static ranks "
            "(--node-rank) it changes nothing there but silences this warning."
        )
        # the worker's log points at the line that joined the group, not inside course_lib
        assert (said[0].filename, said[0].lineno) == env.caller
        if "mutants" not in Path(D.__file__).parts:
            assert env.caller[0] == __file__


class _CallerSpy(dict):
    """An environment that notes who called the function reading it: the frame above that function's,
    so the check also holds where the function is wrapped (mutmut's trampoline is such a wrapper)."""

    caller: tuple[str, int] | None = None

    def get(self, key, default=None):
        if self.caller is None:
            frame = sys._getframe(2)  # 0: this method, 1: the function reading env, 2: its caller
            self.caller = (frame.f_code.co_filename, frame.f_lineno)
        return super().get(key, default)


# ----------------------------------------------------------------------------------------------
# flat_grads, param_slices


def test_flat_grads_are_fp32_on_the_cpu_with_zeros_where_a_parameter_has_no_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].weight.grad = torch.full((2, 2), 3.0)
    grads = D.flat_grads(model)
    assert grads.tolist() == [3.0] * 4 + [0.0] * 5
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)  # no gradient yet
    assert D.flat_grads(bf16).dtype == torch.float32 and not D.flat_grads(bf16).any()


def test_param_slices_locate_each_parameter_in_the_flat_vector():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    slices = D.param_slices(model)
    assert slices == {
        "0.weight": slice(0, 6),
        "0.bias": slice(6, 8),
        "1.weight": slice(8, 10),
        "1.bias": slice(10, 11),
    }
    flat = D.flat_params(model)
    for name, p in model.named_parameters():
        assert torch.equal(flat[slices[name]], p.detach().flatten())


# ----------------------------------------------------------------------------------------------
# average_gradients, same_on_all_ranks


def _two_linears_with_grads(rank: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 1, bias=False))
    model[0].weight.grad = torch.tensor([[1.0, 2.0]]) * (rank + 1)  # rank 0: [1, 2], rank 1: [2, 4]
    return model  # model[1] has no gradient


def test_average_gradients_leaves_every_rank_with_the_mean_gradient():
    def rank_main(rank):
        model = _two_linears_with_grads(rank)
        D.average_gradients(model)
        return model[0].weight.grad.tolist(), model[1].weight.grad

    assert _on_two_ranks(rank_main) == [([[1.5, 3.0]], None), ([[1.5, 3.0]], None)]


def test_same_on_all_ranks_is_true_on_every_rank_only_when_all_hold_the_same_tensor():
    def rank_main(rank):
        return (
            D.same_on_all_ranks(torch.arange(3.0)),
            D.same_on_all_ranks(torch.arange(3.0) + rank),  # rank 1 differs
        )

    assert _on_two_ranks(rank_main) == [(True, False), (True, False)]


def test_a_single_rank_is_the_same_as_itself(group):
    assert D.same_on_all_ranks(torch.arange(3.0)) is True


def test_same_on_all_ranks_compares_on_the_ranks_device(group, monkeypatch):
    """Under nccl every tensor a collective takes must be on the rank's GPU; the meta device takes the
    GPU's place, and stand-in collectives record the devices they are given."""
    asked, devices = [], []

    def rank_device(rank):
        asked.append(rank)
        return torch.device("meta")

    def collective(tensor, *args, **kwargs):
        devices.append(tensor.device)

    real_equal = torch.equal

    def equal(a, b):  # meta tensors hold no numbers to compare: call them equal
        return True if a.is_meta and b.is_meta else real_equal(a, b)

    monkeypatch.setattr(D, "rank_device", rank_device)
    monkeypatch.setattr(dist, "broadcast", collective)
    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(torch, "equal", equal)
    with pytest.raises(RuntimeError, match="meta"):  # nor a flag to read off
        D.same_on_all_ranks(torch.zeros(2))
    assert asked == [0] and devices == [torch.device("meta")] * 2


# ----------------------------------------------------------------------------------------------
# disable_dropout


def test_disable_dropout_works_on_a_model_without_a_config():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    assert D.disable_dropout(model) is model and model[1].p == 0.0
