"""Lesson 06b's two-process sharding cells on a machine with two GPUs, faked (tests/test_gpu_fakes.py).

With two or more GPUs, ``launch`` without a backend picks nccl (one GPU per process), and the sharding
demo refuses a CUDA rank: the lesson's launch cells must ask for gloo, as its prose says ("2 つの gloo
プロセス"). The cells' own code is read from the notebook and run under a faked two-GPU parent; the
ranks themselves are real processes (no fake there), so they run only if the launch asked for gloo.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch.distributed as dist

from course_lib import distributed
from tests.test_gpu_fakes import FakeCuda

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "06b_memory_and_sharding.ipynb"
LAUNCH = "launch(sh.shard_worker"


def _cells(path: Path) -> tuple[str, list[str]]:
    """The lesson's import cell (the one importing ``launch``) and every cell that launches the demo."""
    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    imports = next(s for s in code if "from course_lib.distributed import launch" in s)
    launches = [s for s in code if LAUNCH in s]
    return imports, launches


@pytest.mark.slow
def test_the_lessons_launch_cells_run_gloo_ranks_beside_two_gpus(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(8, 0), count=2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert distributed.default_backend(2) == "nccl"  # the premise: with no backend named, nccl is picked
    asked: list[str] = []
    real_launch = distributed.launch

    def recorded(fn, world_size=2, args=(), backend=None, **kwargs):
        asked.append(distributed.check_backend(backend, world_size))  # what launch will run
        return real_launch(fn, world_size, args, backend=backend, **kwargs)

    monkeypatch.setattr(distributed, "launch", recorded)
    imports, launches = _cells(LESSON)
    assert len(launches) >= 2, f"the lesson launches the demo twice (found {len(launches)})"
    namespace: dict = {}
    exec(compile(imports, "imports", "exec"), namespace)  # binds launch to the recorded one
    assert namespace["launch"] is recorded
    for i, source in enumerate(launches):
        exec(compile(source, f"launch cell {i}", "exec"), namespace)
    assert asked == ["gloo"] * len(launches), f"backends the launches ran: {asked}"
    results = [v for v in namespace.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
    ranks = [r for res in results for r in res if "backend" in r]
    assert ranks and {r["backend"] for r in ranks} == {"gloo"}, "every rank ran on gloo and returned"
    assert fake.calls["device_count"] >= 1


def test_the_estimator_says_8bit_adamws_step_temporary_is_the_cpu_kernels_under_a_gpu():
    """Lesson 06b's estimator: the 24 / 80 GiB presets use the CPU kernel's 20 B per element (REVIEW GPU 4)."""
    from course_lib import estimator
    from course_lib import memory_model as mm

    gpus = [name for name in estimator.DEVICES if "GPU" in name]
    assert gpus and all(estimator.notes(d, "adamw8bit") == [estimator.GPU_8BIT_NOTE] for d in gpus)
    assert f"{mm.ADAMW8BIT_STEP_BYTES_PER_ELEM} B per element" in estimator.GPU_8BIT_NOTE
    assert estimator.notes("laptop (16 GiB)", "adamw8bit") == []  # on the CPU it is the measured kernel
    assert all(estimator.notes(d, o) == [] for d in gpus for o in ("adamw", "adafactor"))
