"""``python -m course_lib.cli.train``: one process, two processes under torchrun, and kill / resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from course_lib import checkpoints, models
from course_lib.cli import train as command

# Without CUDA the command finds the CPU by itself (the point of the test); with GPUs, stay on the CPU.
CPU = ["--cpu"] if torch.cuda.is_available() else []
TINY = [*CPU, "--train-rows", "32", "--eval-rows", "16", "--batch-size", "4", "--no-progress"]


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


def test_single_process_run_saves_checkpoints_final_model_and_metrics(tmp_path):
    out = tmp_path / "one"
    proc = _run(
        ["--max-steps", "3", "--save-every", "1", "--keep-checkpoints", "2", "--output-dir", str(out)],
        tmp_path,
    )
    _ok(proc)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["processes"] == 1 and metrics["steps_run"] == 3 and metrics["global_batch"] == 4
    assert len(metrics["tokens_per_s"]) == 1 and metrics["total_tokens_per_s"] == metrics["tokens_per_s"][0]
    assert _checkpoints(out) == ["checkpoint-000002", "checkpoint-000003"]  # the newest 2, no temp folder
    assert {p.name for p in (out / "checkpoint-000003").iterdir()} == {
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
    }
    final = models.load_model(str(out / "final"))  # a Hugging Face folder the course can load
    saved = load_file(str(out / "checkpoint-000003" / "model.safetensors"))
    torch.testing.assert_close(final.classifier.weight, saved["classifier.weight"], rtol=0, atol=0)
    assert "tokens/s" in proc.stdout and "total" in proc.stdout


def test_torchrun_two_processes_and_a_killed_run_resumes_to_the_same_parameters(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = ["--max-steps", "6", "--save-every", "2"]

    proc = _run([*steps, "--output-dir", str(full)], tmp_path, processes=2)
    _ok(proc)
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["backend"] == "gloo" and metrics["global_batch"] == 8
    assert metrics["distributed_type"] == "MULTI_CPU" and metrics["steps_run"] == 6
    assert len(metrics["tokens_per_s"]) == 2
    assert metrics["total_tokens_per_s"] == pytest.approx(sum(metrics["tokens_per_s"]))
    assert proc.stdout.count("course_lib.cli.train:") == 1  # logged by the main process only
    assert "rank 1:" in proc.stdout  # ... which reports every process's throughput

    proc = _run([*steps, "--output-dir", str(killed), "--stop-after-steps", "3"], tmp_path, processes=2)
    assert proc.returncode != 0  # it "died" at step 3, after the checkpoint of step 2
    assert _checkpoints(killed) == ["checkpoint-000002"] and not (killed / "final").exists()

    proc = _run([*steps, "--output-dir", str(killed), "--resume"], tmp_path, processes=2)
    _ok(proc)
    resumed = json.loads((killed / "metrics.json").read_text())
    assert resumed["start_step"] == 2 and resumed["steps_run"] == 4
    assert resumed["losses"] == pytest.approx(metrics["losses"][2:], rel=1e-6)
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(killed / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # dropout is on: the RNG state was restored too
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)

    # The same run with 16-bit gradients on the wire: half the bytes, nearly the same training.
    hooked = tmp_path / "fp16-hook"
    proc = _run([*steps, "--output-dir", str(hooked), "--comm-hook", "fp16"], tmp_path, processes=2)
    _ok(proc)
    compressed = json.loads((hooked / "metrics.json").read_text())
    assert compressed["config"]["comm_hook"] == "fp16"
    assert compressed["losses"] == pytest.approx(metrics["losses"], rel=1e-2)
    assert compressed["losses"] != metrics["losses"]  # the hook ran: fp16 rounding changed the gradients


def _final_params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def test_one_process_with_8bit_adamw_and_checkpointing_resumes_bit_exactly(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["--max-steps", "4", "--save-every", "2", "--optimizer", "adamw8bit", "--gradient-checkpointing"]
    _ok(_run([*args, "--output-dir", str(full)], tmp_path))
    assert _run([*args, "--output-dir", str(killed), "--stop-after-steps", "3"], tmp_path).returncode != 0
    _ok(_run([*args, "--output-dir", str(killed), "--resume"], tmp_path))
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["config"]["optimizer"] == "adamw8bit" and metrics["config"]["gradient_checkpointing"]
    a, b = _final_params(full), _final_params(killed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)


def test_torchrun_local_sgd_keeps_rank_states_apart_and_resumes_bit_exactly(tmp_path):
    """Local SGD on 2 processes: no gradient all-reduce (the ranks' optimizer states differ), the
    parameters are averaged every 2 steps, and a killed run resumes to the same final parameters."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    args = ["--max-steps", "6", "--save-every", "2", "--local-sgd-steps", "2"]
    _ok(_run([*args, "--output-dir", str(full)], tmp_path, processes=2))
    checkpoint = full / "checkpoint-000006"
    rank0 = load_file(str(checkpoint / "optimizer-rank0.safetensors"))
    rank1 = load_file(str(checkpoint / "optimizer-rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0), "the ranks' gradients were all-reduced"

    assert _run([*args, "--output-dir", str(killed), "--stop-after-steps", "3"], tmp_path, 2).returncode != 0
    _ok(_run([*args, "--output-dir", str(killed), "--resume"], tmp_path, processes=2))
    a, b = _final_params(full), _final_params(killed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)


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
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        command.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        checkpoints.find_resume_checkpoint("latest", tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoints.find_resume_checkpoint(str(tmp_path), "runs/train")
    assert checkpoints.find_resume_checkpoint(None, tmp_path) is None


def test_bf16_comm_hook_on_gloo_says_to_use_fp16():
    from course_lib.training.ddp import register_comm_hook

    class FakeDDP(torch.nn.Linear):
        def register_comm_hook(self, state, hook):  # a DDP model's method; never reached here
            raise AssertionError("registered a bf16 hook on gloo")

    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match=r"NCCL backend .* only; this run uses gloo.*this build: CUDA .*--comm-hook fp16"
        ):
            register_comm_hook(FakeDDP(2, 2), "bf16")
    finally:
        torch.distributed.destroy_process_group()
    register_comm_hook(torch.nn.Linear(2, 2), "bf16")  # not DDP (one process): nothing to compress


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is fine on a GPU")
def test_fp16_on_a_cpu_is_refused():
    with pytest.raises(ValueError, match="bf16"):
        command.resolve_precision("fp16", cpu=False)
    assert command.resolve_precision("no", cpu=True) == "no"
