"""`make lab` starts JupyterLab the way the browser tier tests it (no browser needed here)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from browser_lab import ROOT

OFFLINE = ("HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "TRANSFORMERS_OFFLINE=1")


def lab_command(**env: str) -> str:
    """The command `make lab` would run (make -n: nothing is run or installed)."""
    environ = {
        k: v for k, v in os.environ.items() if k not in ("COURSE_MODEL", "COURSE_DATASET", "MAKEFLAGS")
    }
    result = subprocess.run(
        ["make", "-n", "lab"], cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, check=True
    )
    return next(line for line in reversed(result.stdout.splitlines()) if "jupyter lab" in line)


pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.mark.parametrize(
    "env",
    [{}, {"COURSE_MODEL": "embedded"}, {"COURSE_MODEL": "embedded", "COURSE_DATASET": "embedded"}],
)
def test_make_lab_is_offline_with_the_embedded_default(env):
    command = lab_command(**env)
    assert all(flag in command for flag in OFFLINE), command


@pytest.mark.parametrize(
    "env",
    [{"COURSE_MODEL": "distilbert-base-uncased"}, {"COURSE_DATASET": "hub"}],
)
def test_make_lab_goes_online_for_the_hub(env):
    command = lab_command(**env)
    assert not any(flag in command for flag in OFFLINE), command


def test_make_lab_reads_the_course_settings():
    command = lab_command()
    assert f'JUPYTER_CONFIG_PATH="{ROOT}/jupyter' in command, command
    assert (ROOT / "jupyter" / "jupyter_server_config.py").is_file()
