"""Suite-wide set-up, for every test (tests/, and notebooks/ and solutions/ under nbval).

* Offline: the Hugging Face switches are set, and ``tests/netguard`` goes on ``PYTHONPATH`` so this
  process and every child Python process (notebook kernels, torchrun workers, nbgrader) raise on any
  connection that leaves the machine.
* Threads: see CONTRIBUTING, "Threads and load". Kernels and workers keep torch's default thread
  count, but idle OpenMP threads sleep instead of spinning, so a competing process (a second
  kernel, the learner's browser, a background job) does not turn spinning into a 5-10x slow-down.
* Tiers: ``make test`` runs everything; ``make test-fast`` (``pytest -m "not slow"``) leaves out what
  ``SLOW`` names (whole lesson and solution notebooks, the grading cycle, multi-process and
  benchmark runs), for a quick check while developing.
* Notebook cells (nbval): ``tests/plugins/nbval_budget.py`` bounds the messages a cell may send and
  waits longer than nbval's hard-coded 5 s for a finished cell's output.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NETGUARD = ROOT / "tests" / "netguard"
PLUGINS = ROOT / "tests" / "plugins"


os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(NETGUARD), os.environ.get("PYTHONPATH", "")])),
    }
)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path[:0] = [str(NETGUARD), str(PLUGINS)]
import sitecustomize  # noqa: E402,F401  (installs the guard in this process)

pytest_plugins = ["nbval_budget", "nbval_stderr"]

# Node-id prefixes of the slow tier: each takes from several seconds to minutes on 2 cores.
SLOW = (
    "notebooks/01",
    "notebooks/02",
    "notebooks/03",
    "notebooks/04",
    "notebooks/05",
    "notebooks/06",
    "notebooks/07",
    "solutions/",
    "tests/browser/",
    "tests/test_grading.py",
    "tests/test_check.py",
    "tests/test_train_cli.py",
    "tests/test_distributed.py::test_two",
    "tests/test_distributed.py::test_sharding_every",
    "tests/test_distributed.py::test_replication",
    "tests/test_distributed.py::test_one_step",
    "tests/test_distributed.py::test_gradient_accumulation_under_ddp",
    "tests/test_bench.py::test_quick_run",
    "tests/test_bench.py::test_peak_rss",
    "tests/test_bench.py::test_cpu_memory_probe",
    "tests/test_experiments.py::test_fine_tuning",
    "tests/test_experiments.py::test_both_runs",
    "tests/test_experiments.py::test_cli",
    "tests/test_demos_local_sgd.py::test_two_ranks_count_and_drift",
    "tests/test_recipe.py::test_quick_ladder",
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast)")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker("slow")
