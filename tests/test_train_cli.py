"""``python -m course_lib.cli.train``: one process, two processes under torchrun, and kill / resume."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from course_lib import checkpoints, models, training
from course_lib.cli import train as command

# Without CUDA the command finds the CPU by itself (the point of the test); with GPUs, stay on the CPU.
CPU = ["--cpu"] if torch.cuda.is_available() else []
TINY = [*CPU, "--train-rows", "32", "--eval-rows", "16", "--batch-size", "4", "--no-progress"]
# The two-process DDP run of the session (tests/conftest.py's ``ddp_run``): accumulation and clipping on,
# so that test_train_fsdp's FSDP run has the clipped global norm and the accumulation window to match.
DDP_STEPS = ["--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "2", "--grad-accum-steps", "2"]
DDP_STEPS += ["--max-grad-norm", "0.1"]


def _run(args: list[str], cwd: Path, processes: int = 1) -> subprocess.CompletedProcess:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
    ]
    cmd = (launcher if processes > 1 else [sys.executable]) + ["-m", "course_lib.cli.train", *TINY, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ})


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", ".tmp")))


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _final_params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **tolerance)


def _assert_resumed(proc, out: Path, full: dict, checkpoint: Path, start: int, steps: int) -> dict:
    """The run in ``out`` loaded ``checkpoint`` (step ``start``) and made only steps start+1..steps."""
    _ok(proc)
    assert f"resumed from {checkpoint} at step {start}" in proc.stdout, proc.stdout
    assert f"steps {start + 1}..{steps}" in proc.stdout, proc.stdout
    resumed = _metrics(out)
    assert (resumed["start_step"], resumed["steps_run"]) == (start, steps - start)
    assert len(resumed["losses"]) == steps - start  # the steps it trained, no more
    assert resumed["losses"] == pytest.approx(
        full["losses"][start:], rel=1e-6
    )  # the same steps as the full run
    return resumed


@pytest.mark.slow  # launches the command (several seconds each)
def test_one_process_checkpoints_is_killed_and_resumes_bit_exactly_with_8bit_adamw_and_checkpointing(
    tmp_path,
):
    """One process: checkpoints (the newest kept), final model, metrics; a run stopped by
    --stop-after-steps exits with its status and leaves its last checkpoint; --resume continues
    from that step to the uninterrupted run's final parameters, bit for bit (the stop acts only in a
    run that starts from nothing)."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "2"]
    args += ["--optimizer", "adamw8bit", "--gradient-checkpointing"]
    proc = _run([*args, "--output-dir", str(full)], tmp_path)
    _ok(proc)
    metrics = _metrics(full)
    assert metrics["processes"] == 1 and metrics["global_batch"] == 4
    assert (metrics["start_step"], metrics["steps_run"], len(metrics["losses"])) == (0, 4, 4)
    assert metrics["config"]["optimizer"] == "adamw8bit" and metrics["config"]["gradient_checkpointing"]
    assert len(metrics["tokens_per_s"]) == 1 and metrics["total_tokens_per_s"] == metrics["tokens_per_s"][0]
    assert _checkpoints(full) == ["checkpoint-000003", "checkpoint-000004"]  # the newest 2, no temp folder
    assert {p.name for p in (full / "checkpoint-000004").iterdir()} == {
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
    }
    assert json.loads((full / "checkpoint-000004" / "state.json").read_text())["step"] == 4
    final = models.load_model(str(full / "final"))  # a Hugging Face folder the course can load
    saved = load_file(str(full / "checkpoint-000004" / "model.safetensors"))
    torch.testing.assert_close(final.classifier.weight, saved["classifier.weight"], rtol=0, atol=0)
    assert "tokens/s" in proc.stdout and "total" in proc.stdout

    proc = _run([*args, "--output-dir", str(killed), "--stop-after-steps", "2"], tmp_path)
    assert proc.returncode == command.EXIT_STOPPED, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--stop-after-steps 2: rank 0 exiting at step 2 as if killed" in proc.stdout
    assert _checkpoints(killed) == ["checkpoint-000001", "checkpoint-000002"]  # complete, no temp folder
    assert not (killed / "final").exists() and not (killed / "metrics.json").exists()
    assert json.loads((killed / "checkpoint-000002" / "state.json").read_text())["step"] == 2

    # the same command resumed: --stop-after-steps simulates one crash, and a resumed run goes to the end
    proc = _run([*args, "--output-dir", str(killed), "--stop-after-steps", "2", "--resume"], tmp_path)
    _assert_resumed(proc, killed, metrics, killed / "checkpoint-000002", start=2, steps=4)
    _assert_same_params(_final_params(full), _final_params(killed), rtol=0, atol=0)


@pytest.mark.slow  # launches the command (several seconds each)
def test_torchrun_two_processes_resume_from_a_checkpoint_and_compress_gradients(ddp_run, tmp_path):
    """Two processes under torchrun (gloo), with accumulation and clipping (the session's ``ddp_run``,
    which test_train_fsdp compares FSDP with): a second run resumed from its step-2 checkpoint (to the
    same final parameters: data order and dropout RNG restored), and the run with fp16 gradients on
    the wire. (The stop flag's exit and left-behind checkpoint: above.)"""
    proc, full = ddp_run
    resumed, hooked = tmp_path / "resumed", tmp_path / "fp16-hook"
    metrics = _metrics(full)
    assert metrics["processes"] == 2 and metrics["backend"] == "gloo" and metrics["global_batch"] == 16
    assert metrics["distributed_type"] == "MULTI_CPU" and metrics["steps_run"] == 4
    assert len(metrics["tokens_per_s"]) == 2
    assert metrics["total_tokens_per_s"] == pytest.approx(sum(metrics["tokens_per_s"]))
    assert proc.stdout.count("course_lib.cli.train:") == 1  # logged by the main process only
    assert "rank 1:" in proc.stdout  # ... which reports every process's throughput
    assert _checkpoints(full) == ["checkpoint-000002", "checkpoint-000004"]
    assert json.loads((full / "checkpoint-000002" / "state.json").read_text())["world_size"] == 2

    checkpoint = full / "checkpoint-000002"
    proc = _run(
        [*DDP_STEPS, "--output-dir", str(resumed), "--resume", str(checkpoint)], tmp_path, processes=2
    )
    _assert_resumed(proc, resumed, metrics, checkpoint, start=2, steps=4)
    assert "note:" not in proc.stdout  # same world size: the RNG states were restored, rank by rank
    # dropout is on: equal final parameters need the restored RNG states too
    _assert_same_params(_final_params(full), _final_params(resumed), rtol=1e-6, atol=1e-7)

    # The same run with 16-bit gradients on the wire: half the bytes, nearly the same training.
    proc = _run([*DDP_STEPS, "--output-dir", str(hooked), "--comm-hook", "fp16"], tmp_path, processes=2)
    _ok(proc)
    compressed = _metrics(hooked)
    assert compressed["config"]["comm_hook"] == "fp16"
    assert compressed["losses"] == pytest.approx(metrics["losses"], rel=1e-2)
    assert compressed["losses"] != metrics["losses"]  # the hook ran: fp16 rounding changed the gradients


@pytest.mark.slow  # launches the command (several seconds each)
def test_torchrun_local_sgd_keeps_rank_states_apart_and_resumes_bit_exactly(tmp_path):
    """Local SGD on 2 processes: no gradient all-reduce (the ranks' optimizer states differ), the
    parameters are averaged every 2 steps, and a run resumed from a checkpoint reaches the same
    final parameters (each rank's own optimizer state restored)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = ["--max-steps", "6", "--save-every", "2", "--keep-checkpoints", "3", "--local-sgd-steps", "2"]
    _ok(_run([*args, "--output-dir", str(full)], tmp_path, processes=2))
    metrics = _metrics(full)
    checkpoint = full / "checkpoint-000006"
    rank0 = load_file(str(checkpoint / "optimizer-rank0.safetensors"))
    rank1 = load_file(str(checkpoint / "optimizer-rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0), "the ranks' gradients were all-reduced"

    checkpoint = full / "checkpoint-000002"
    proc = _run([*args, "--output-dir", str(resumed), "--resume", str(checkpoint)], tmp_path, processes=2)
    _assert_resumed(proc, resumed, metrics, checkpoint, start=2, steps=6)
    _assert_same_params(_final_params(full), _final_params(resumed), rtol=0, atol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--max-steps", "0"], "--max-steps must be >= 1"),
        (["--lr", "-1"], "--lr must be positive"),
        (["--precision", "fp8"], "Unknown precision"),
        (["--dataset", "imagenet"], "invalid choice"),
        (["--optimizer", "sgd"], "invalid choice"),
        (["--comm-hook", "int8"], "invalid choice"),
        (["--local-sgd-steps", "0"], "--local-sgd-steps must be >= 1"),
        (["--local-sgd-steps", "3", "--save-every", "4"], "not a multiple of --local-sgd-steps"),
        (["--local-sgd-steps", "2", "--save-every", "4", "--comm-hook", "fp16"], "use one of the two"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be positive (or None: no clipping)"),
        (["--max-grad-norm", "big"], "invalid float value"),
        (
            ["--optimizer", "adafactor", "--fused-adamw", "yes"],
            "--fused-adamw applies to --optimizer adamw only",
        ),
        (["--fsdp", "--local-sgd-steps", "2", "--save-every", "4"], "use --fsdp or those, not both"),
        (["--fsdp", "--optimizer", "adafactor"], "--fsdp runs with --optimizer adamw only"),
        (["--warmup-ratio", "1"], "--warmup-ratio in [0, 1)"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        command.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_training_flags_are_train_configs_fields_declared_once():
    """Every TrainConfig field is a flag or set by the command (both ways); defaults come from it."""
    names = {f.name for f in dataclasses.fields(training.TrainConfig)}
    assert set(command.TRAIN_FLAGS) | set(command.SET_BY_COMMAND) == names
    assert not set(command.TRAIN_FLAGS) & set(command.SET_BY_COMMAND)
    assert command.parse_args([]).train == training.TrainConfig()  # the same defaults, no second copy
    cfg = command.parse_args(["--lr", "1e-3", "--no-eval", "--fused-adamw", "no", "--max-grad-norm", "none"])
    assert (cfg.train.lr, cfg.train.eval_every_epoch, cfg.train.fused_optimizer) == (1e-3, False, False)
    assert cfg.train.max_grad_norm is None
    flat = cfg.as_dict()
    assert "train" not in flat and flat["lr"] == 1e-3 and flat["batch_size"] == 16
    assert set(flat) == names | {f.name for f in dataclasses.fields(cfg)} - {"train"}


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        checkpoints.find_resume_checkpoint("latest", tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoints.find_resume_checkpoint(str(tmp_path), "runs/train")
    assert checkpoints.find_resume_checkpoint(None, tmp_path) is None


def test_bf16_comm_hook_on_gloo_says_to_use_fp16(tmp_path):
    from course_lib.training.ddp import register_comm_hook

    class FakeDDP(torch.nn.Linear):
        def register_comm_hook(self, state, hook):  # a DDP model's method; never reached here
            raise AssertionError("registered a bf16 hook on gloo")

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)  # no port to race for
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match=r"NCCL backend .* only; this run uses gloo.*this build: CUDA .*--comm-hook fp16"
        ):
            register_comm_hook(FakeDDP(2, 2), "bf16")
    finally:
        torch.distributed.destroy_process_group()
    register_comm_hook(torch.nn.Linear(2, 2), "bf16")  # not DDP (one process): nothing to compress


# fp16 refused on a CPU and allowed on a GPU: tests/test_gpu_fakes.py (both, on any machine).
