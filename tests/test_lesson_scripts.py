"""Each lesson's clean script (its cell tagged ``lesson-script``), run as a learner runs it.

The script is copied out of the notebook into a file of its own and run in a fresh process: ``python
script.py``, or with two gloo processes through ``torchrun`` when the cell is also tagged
``script-torchrun``. It must end without error, print ``loss: A -> B`` with B below A (it trains), and
print what shows that it uses its lesson's technique (``USES``: a pattern per lesson, matched against
what the script prints, e.g. the optimizer state's dtype, the number of all-reduces, the peak). Its
lines are marked ``# NEW`` against lesson 01's plain loop, and it holds no probe or recorder.
"""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SCRIPT_TAG, TORCHRUN_TAG = "lesson-script", "script-torchrun"
MAX_LINES = 40  # "at most about 30 lines": code lines, without blank lines, comments and the docstring
LOSS = re.compile(r"^loss: ([0-9.]+) -> ([0-9.]+)", re.M)
INSTRUMENTS = re.compile(
    r"\b(StepProbe|StepRecorder|\w*Recorder|counting_all_reduce|on_step|probe|apparatus)\b"
)

# What each script prints that shows its technique at work (a regular expression over its stdout).
USES: dict[str, str] = {
    "00_intro": r"GFLOP/s",
    "01_device_placement": r"steps on \w+",
    "01b_images_audio": r"pixel_values \(\d+, 3, 32, 32\) torch\.float32",
    "02_distributed_concepts": r"2 rank\(s\), parameters identical: True, steps per rank: \[(\d+), \1\]",
    "03_mixed_precision": r"bfloat16|float16|autocast",
    "04_accumulation_checkpointing": r"accumulat|checkpoint",
    "05_local_sgd": r"LocalSGD: 2 プロセス、[^\n]*平均 [1-9]",
    "06_efficient_optimizers": r"bytes",
    "06b_memory_and_sharding": r"bytes|shard",
    "07_time_to_accuracy": r"accuracy|padding",
}


def _script(path: Path) -> tuple[str, bool] | None:
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if SCRIPT_TAG in c.metadata.get("tags", [])]
    if not cells:
        return None
    assert len(cells) == 1, f"{path.name}: one cell tagged '{SCRIPT_TAG}'"
    return cells[0].source, TORCHRUN_TAG in cells[0].metadata.get("tags", [])


def _run(path: Path, folder: Path) -> subprocess.CompletedProcess | None:
    found = _script(path)
    if found is None:
        return None
    source, torchrun = found
    script = folder / f"{path.stem}.py"
    script.write_text(source + "\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1" if torchrun else os.environ.get("OMP_NUM_THREADS", "2")}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*(launcher if torchrun else [sys.executable]), str(script)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, subprocess.CompletedProcess | None]:
    """The scripts of the lessons this session selected, two at a time (2 cores; each is mostly imports)."""
    selected = {
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_the_script_trains_and_uses_its_technique"
    }
    folder = tmp_path_factory.mktemp("scripts")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(lambda p: (p.stem, _run(p, folder)), sorted(selected)))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_the_script_is_short_clean_and_marks_what_is_new(path):
    found = _script(path)
    assert found is not None, f"{path.name}: no cell tagged '{SCRIPT_TAG}'"
    source, _ = found
    code = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= MAX_LINES, f"{len(code)} code lines (at most {MAX_LINES})"
    assert not INSTRUMENTS.search(source), (
        f"no probes or recorders in the script: {INSTRUMENTS.search(source)}"
    )
    if path.stem != "01_device_placement":  # lesson 01's loop is the plain one the others change
        assert "# NEW" in source, "the technique's lines are marked # NEW"
    compile(source, path.name, "exec")


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_the_script_trains_and_uses_its_technique(path, runs):
    proc = runs[path.stem]
    assert proc is not None, f"{path.name}: no cell tagged '{SCRIPT_TAG}'"
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    loss = LOSS.search(proc.stdout)
    assert loss, f"the script prints 'loss: A -> B':\n{proc.stdout[-2000:]}"
    assert float(loss.group(2)) < float(loss.group(1)), f"the loss does not fall: {loss.group(0)}"
    assert re.search(USES[path.stem], proc.stdout), (
        f"no sign of the technique ({USES[path.stem]!r}):\n{proc.stdout}"
    )
