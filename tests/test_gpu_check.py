"""scripts/gpu_check.sh: the prepared GPU check. Without a GPU it must say so and change nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs for real")
def test_without_a_gpu_the_check_says_so_and_exits_2(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "No CUDA GPU here" in proc.stdout and "cuda_available: False" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["machine.log", "summary.md"]


def test_every_module_the_check_runs_exists():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for module in ("course_lib.cli.train", "course_lib.cli.bench", "course_lib.cli.recipe"):
        assert f"-m {module}" in script
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
