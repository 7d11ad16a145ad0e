"""Suite-wide set-up, for every test (tests/, and notebooks/ under nbval; solutions/ when named).

* Offline: the Hugging Face switches are set, and ``tests/netguard`` goes on ``PYTHONPATH`` so this
  process and every child Python process (notebook kernels, torchrun workers, nbgrader) raise on any
  connection that leaves the machine.
* Threads: see CONTRIBUTING, "Threads and load". Kernels and workers keep torch's default thread
  count, but idle OpenMP threads sleep instead of spinning, so a competing process (a second
  kernel, the learner's browser, a background job) does not turn spinning into a 5-10x slow-down.
* Tiers: ``make test`` runs everything; ``make test-fast`` (``pytest -m "not slow"``) leaves out the
  tests marked ``@pytest.mark.slow`` where they are defined (multi-process and benchmark runs, the
  command-line launches, the browser tier) and what ``SLOW_PATHS`` names here (whole lesson and
  solution notebooks, which cannot be decorated), for a quick check while developing.
* No test may leave a ``torch.distributed`` process group behind (the next one would join it).
* Notebook cells (nbval): ``tests/plugins/nbval_budget.py`` bounds the messages a cell may send and
  waits longer than nbval's hard-coded 5 s for a finished cell's output.
"""

import os
import sys
from pathlib import Path

import pytest

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

# Node-id prefixes of the slow tier for what cannot carry a mark: notebooks run whole under nbval
# (lessons 01-07; lesson 00 is quick), and two files whose owners mark their slow tests next.
# Everything else that is slow carries ``@pytest.mark.slow`` (or a module ``pytestmark``) itself.
SLOW_PATHS = (
    "notebooks/01",
    "notebooks/02",
    "notebooks/03",
    "notebooks/04",
    "notebooks/05",
    "notebooks/06",
    "notebooks/07",  # (a prefix: 01 covers 01b, 06 covers 06b)
    "solutions/",
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast)")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW_PATHS):
            item.add_marker("slow")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """Fail the test that leaves a ``torch.distributed`` process group initialised (and destroy it)."""
    yield
    dist = sys.modules.get("torch.distributed")  # never imported by this fixture
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("This test left a torch.distributed process group behind: destroy it in a finally block.")
