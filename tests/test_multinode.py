"""Beyond one machine, on one machine: ``python -m course_lib.cli.train`` under two torchrun node agents.

Two ``torchrun`` processes on localhost, each its own node (``--nnodes 2``, one worker each), form one
process group exactly as two machines would: the same rendezvous (a static ``--node-rank`` with
``--master-addr``, or the c10d rendezvous), the same TCP store, gloo over TCP. What differs on real
machines (a network between them, GPUs and nccl) is not tested here: docs/distributed.md says so.

- two nodes end on the one-node two-process run's final parameters (``ddp_run``: the same global batch),
  under DDP and ``--fsdp``, through torchrun and through ``accelerate launch --num_machines 2``, and only
  the main process writes;
- a worker killed mid-run (``--stop-after-steps N --stop-rank 1``) is restarted by torchrun's elastic agent
  (``--max-restarts 1``), ``--resume auto`` continues from the newest complete checkpoint, and the run ends
  on the uninterrupted run's parameters, bit for bit; on one node, and across two c10d node agents;
- a process killed while it writes a checkpoint leaves the previous one usable;
- the first mistakes of a multi-node launch end with a message in bounded time, not a hang.
"""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_train_cli import DDP_STEPS, TINY, _assert_same_params, _final_params, _metrics
from test_train_fsdp import TOLERANCE

from course_lib import checkpoints

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun node agents on localhost (Linux)")
TRAIN = ["-m", "course_lib.cli.train", *TINY, *DDP_STEPS]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 600  # seconds for a whole two-node run (about 15 s on 2 quiet cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(
    commands: list[list[str]], cwd: Path, timeout: int = TIMEOUT, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Start every node's command at once (as on two machines), wait for all; kill all on a timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in commands
    ]
    deadline, results = time.monotonic() + timeout, []
    try:
        for cmd, proc in zip(commands, procs, strict=True):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _ok(results: list[subprocess.CompletedProcess]) -> None:
    for r in results:
        assert r.returncode == 0, f"{r.args}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _writers(outs: list[Path]) -> list[int]:
    """The nodes whose output folder holds anything (only the main process writes)."""
    return [i for i, out in enumerate(outs) if out.exists() and any(out.iterdir())]


@pytest.mark.slow  # two node agents, two workers (about 15 s on 2 cores)
def test_two_nodes_with_static_ranks_end_on_the_one_node_parameters(ddp_run, tmp_path):
    """torchrun --nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1: global ranks 0 and 1 are the nodes'
    workers, so the run is the one-node two-process run: the same parameters, bit for bit on one CPU;
    node 0's worker is the main process and writes everything, node 1 writes nothing."""
    port, outs = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    static = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    commands = [
        [*static, "--master-port", str(port), "--node-rank", str(r), *TRAIN, "--output-dir", str(outs[r])]
        for r in (0, 1)
    ]
    results = run_nodes(commands, tmp_path)
    _ok(results)
    assert _writers(outs) == [0]
    metrics = _metrics(outs[0])
    assert (metrics["processes"], metrics["backend"], metrics["global_batch"]) == (2, "gloo", 16)
    _assert_same_params(_final_params(ddp_run[1]), _final_params(outs[0]), rtol=0, atol=0)
    assert checkpoints.list_checkpoints(outs[0])[-1][0] == 4


@pytest.mark.slow  # two node agents, two workers
def test_two_nodes_through_the_c10d_rendezvous_under_fsdp_match_ddp(ddp_run, tmp_path):
    """torchrun --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT (no node ranks: the rendezvous
    assigns them) with --fsdp: each worker holds half the parameters; the final parameters equal the
    one-node DDP run's within FSDP's tolerance (tests/test_train_fsdp.py); one node writes."""
    port, outs = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    rdzv = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "course-two-nodes"]
    commands = [[*rdzv, *TRAIN, "--fsdp", "--output-dir", str(out)] for out in outs]
    results = run_nodes(commands, tmp_path)
    _ok(results)
    (writer,) = _writers(outs)  # whichever node the rendezvous made rank 0
    metrics = _metrics(outs[writer])
    assert metrics["processes"] == 2 and len(set(metrics["parameters_per_process"])) <= 2
    assert sum(metrics["parameters_per_process"]) == metrics["parameters"]  # sharded, not replicated
    _assert_same_params(_final_params(ddp_run[1]), _final_params(outs[writer]), **TOLERANCE)


@pytest.mark.slow  # two accelerate launchers, two workers
def test_two_nodes_through_accelerate_launch_end_on_the_one_node_parameters(ddp_run, tmp_path):
    """accelerate launch --multi_gpu --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1: on a
    machine without CUDA the workers join over gloo (MULTI_CPU), as the docs' command says."""
    port, outs = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2"]
    launch += ["--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    commands = [[*launch, "--machine_rank", str(r), *TRAIN, "--output-dir", str(outs[r])] for r in (0, 1)]
    results = run_nodes(commands, tmp_path)
    _ok(results)
    assert _writers(outs) == [0]
    assert _metrics(outs[0])["distributed_type"] == "MULTI_CPU"
    _assert_same_params(_final_params(ddp_run[1]), _final_params(outs[0]), rtol=0, atol=0)


@pytest.mark.slow  # two attempts of a two-process group
def test_a_killed_worker_is_restarted_by_torchrun_and_ends_on_the_uninterrupted_parameters(ddp_run, tmp_path):
    """Rank 1 dies after step 3 (checkpoints every 2 steps); torchrun --max-restarts 1 restarts the group;
    --resume auto loads checkpoint 2, so step 3 is computed again (1 step recomputed) and the run ends on
    the uninterrupted run's parameters, bit for bit; the first attempt started from nothing."""
    out = tmp_path / "elastic"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *TRAIN]
    cmd += ["--output-dir", str(out), "--resume", "auto", "--stop-after-steps", "3", "--stop-rank", "1"]
    (result,) = run_nodes([cmd], tmp_path)
    _ok([result])
    log = result.stdout + result.stderr
    assert "rank 1 exiting at step 3 as if killed" in log, log[-3000:]
    assert f"resumed from {out / 'checkpoint-000002'} at step 2" in result.stdout, result.stdout[-3000:]
    metrics = _metrics(out)
    assert (metrics["restarts"], metrics["start_step"], metrics["steps_run"]) == (1, 2, 2)
    recomputed = 3 - metrics["start_step"]  # the killed attempt got to step 3; the restart redid it
    assert recomputed == 1
    _assert_same_params(_final_params(ddp_run[1]), _final_params(out), rtol=0, atol=0)
    assert [s for s, _ in checkpoints.list_checkpoints(out)] == [2, 4]
    assert not list(out.glob(".tmp-*")), "a half-written checkpoint was left"


@pytest.mark.slow  # two node agents, two attempts
def test_a_killed_worker_on_one_of_two_c10d_nodes_restarts_both_and_ends_on_the_uninterrupted_parameters(
    ddp_run, tmp_path
):
    """docs/distributed.md's multi-node recipe: two c10d node agents with --max-restarts 1 and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (each attempt a fresh store), one output folder for both (a
    shared file system). Node 1's worker dies after step 3; node 0's agent sees the group change and
    restarts too (each agent counts its own attempts: its count may stay 0, which is why the variable is
    needed); the new group resumes from checkpoint 2 and ends on the uninterrupted run's parameters."""
    port, out = free_port(), tmp_path / "shared"
    rdzv = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--max-restarts"]
    rdzv += ["1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "course-restart-two-nodes"]
    cmd = [*rdzv, *TRAIN, "--output-dir", str(out), "--resume", "auto"]
    cmd += ["--stop-after-steps", "3", "--stop-rank", "1"]
    results = run_nodes([cmd, cmd], tmp_path, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    _ok(results)
    logs = [r.stdout + r.stderr for r in results]
    assert sum(log.count("rank 1 exiting at step 3 as if killed") for log in logs) == 1, logs
    assert not any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node" in log for log in logs)  # it is set
    metrics = _metrics(out)
    assert (metrics["processes"], metrics["start_step"], metrics["steps_run"]) == (2, 2, 2)
    _assert_same_params(_final_params(ddp_run[1]), _final_params(out), rtol=0, atol=0)
    assert [s for s, _ in checkpoints.list_checkpoints(out)] == [2, 4]


KILLED_IN_A_SAVE = """
import os, signal, sys
import accelerate.utils, torch
from course_lib import checkpoints

class OneProcess:
    device, num_processes, process_index, is_main_process, scaler = torch.device("cpu"), 1, 0, True, None
    def wait_for_everyone(self):
        pass

accelerate.utils.gather_object = lambda obj: obj  # one process: itself
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
checkpoints.save_checkpoint(sys.argv[1], 1, model, optimizer, OneProcess(), {"step": 1})
with torch.no_grad():
    model.weight.add_(1.0)
write_model = checkpoints.save_optimizer
def die_halfway(optimizer, path):  # the model file of step 2 is written, then the process is killed
    os.kill(os.getpid(), signal.SIGKILL)
checkpoints.save_optimizer = die_halfway
checkpoints.save_checkpoint(sys.argv[1], 2, model, optimizer, OneProcess(), {"step": 2})
"""


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    script = tmp_path / "killed_in_a_save.py"
    script.write_text(textwrap.dedent(KILLED_IN_A_SAVE))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr  # SIGKILL, in the middle of the save
    run = tmp_path / "run"
    assert (run / ".tmp-checkpoint-000002" / "model.safetensors").is_file()  # half written, set aside
    assert [s for s, _ in checkpoints.list_checkpoints(run)] == [1]
    latest = checkpoints.find_resume_checkpoint("latest", run)
    assert latest == checkpoints.checkpoint_dir(run, 1)
    assert checkpoints.find_resume_checkpoint("auto", run) == latest

    class OneProcess:
        device, num_processes, process_index, is_main_process, scaler = torch.device("cpu"), 1, 0, True, None

        def wait_for_everyone(self) -> None:
            pass

    torch.manual_seed(0)
    expected = torch.nn.Linear(3, 2).weight.detach().clone()  # the weights saved at step 1
    model = torch.nn.Linear(3, 2)
    assert (
        checkpoints.load_checkpoint(latest, model, torch.optim.SGD(model.parameters(), lr=0.1), OneProcess())
        == 1
    )
    assert torch.equal(model.weight, expected)
    import accelerate.utils  # the resumed run saves step 2 again: the half-written folder goes

    monkeypatch.setattr(accelerate.utils, "gather_object", lambda obj: obj)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints.save_checkpoint(run, 2, model, optimizer, OneProcess(), {})
    assert [s for s, _ in checkpoints.list_checkpoints(run)] == [1, 2] and not list(run.glob(".tmp-*"))


def test_resume_auto_starts_from_nothing_when_there_is_no_checkpoint(tmp_path):
    assert checkpoints.find_resume_checkpoint("auto", tmp_path / "new") is None
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        checkpoints.find_resume_checkpoint("latest", tmp_path / "new")


def test_check_launch_refuses_nodes_with_different_process_counts_and_a_rank_out_of_range():
    from course_lib.cli.train import check_launch

    node = {
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2",
        "RANK": "3",
        "GROUP_RANK": "1",
    }
    check_launch(node)  # 2 nodes x 2 processes
    check_launch({"WORLD_SIZE": "2"})  # not a torchrun worker (notebook_launcher, distributed.launch)
    for world, local in (("3", "1"), ("3", "2"), ("5", "2")):  # a node with 1 or 2 beside one with 2 or 3
        with pytest.raises(ValueError, match="same --nproc-per-node"):
            check_launch({**node, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local, "RANK": "0"})
    for rank in ("4", "-1", "7"):
        with pytest.raises(ValueError, match="--node-rank must be"):
            check_launch({**node, "RANK": rank})


@pytest.mark.slow  # two node agents whose three workers stop at once
def test_nodes_started_with_different_process_counts_fail_with_a_message_not_a_run(tmp_path):
    """torchrun would join 1 + 2 processes into one group of 3 (another global batch than either command
    says); the command refuses it on every worker before the process group forms, in seconds."""
    port = free_port()
    static = [*TORCHRUN, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    commands = [
        [
            *static,
            "--node-rank",
            str(r),
            "--nproc-per-node",
            str(r + 1),
            *TRAIN,
            "--output-dir",
            str(tmp_path / f"n{r}"),
        ]
        for r in (0, 1)
    ]
    started = time.monotonic()
    results = run_nodes(commands, tmp_path, timeout=300)
    assert all(r.returncode != 0 for r in results), [r.returncode for r in results]
    assert any("same --nproc-per-node" in r.stderr + r.stdout for r in results)
    assert not any((tmp_path / f"n{r}").exists() for r in (0, 1))  # nothing trained, nothing written
    print(f"refused in {time.monotonic() - started:.0f} s")


@pytest.mark.slow  # one node agent
def test_a_master_port_in_use_fails_at_once_with_the_cause(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*TORCHRUN, "--nnodes", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
        cmd += ["--master-port", str(port), *TRAIN, "--output-dir", str(tmp_path / "out")]
        (result,) = run_nodes([cmd], tmp_path, timeout=300)
    assert result.returncode != 0
    assert "EADDRINUSE" in result.stderr or "address already in use" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow  # two node agents that wait out a 20 s rendezvous timeout
def test_a_node_rank_out_of_range_ends_at_the_rendezvous_timeout_naming_the_missing_node(tmp_path):
    """--node-rank 2 of --nnodes 2: the agents wait in torchrun's rendezvous before the command starts
    (no code of the course can run yet); --rdzv-conf timeout=20 ends both within a bounded time, and the
    message names the node rank nobody took (role_info/1) and the one out of range (assigned_ranks/2)."""
    port = free_port()
    static = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    static += ["--master-port", str(port), "--rdzv-conf", "timeout=20"]
    commands = [
        [*static, "--node-rank", r, *TRAIN, "--output-dir", str(tmp_path / f"n{r}")] for r in ("0", "2")
    ]
    started = time.monotonic()
    first, second = run_nodes(commands, tmp_path, timeout=300)
    assert first.returncode != 0 and second.returncode != 0
    assert "role_info/1" in first.stderr, first.stderr[-2000:]
    assert "assigned_ranks/2" in second.stderr, second.stderr[-2000:]
    assert time.monotonic() - started < 280  # bounded by the timeout, not by the test's own limit
