"""Test-wide set-up: offline, network guarded in this process and in every child Python process."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NETGUARD = ROOT / "tests" / "netguard"

os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(NETGUARD), os.environ.get("PYTHONPATH", "")])),
    }
)
sys.path.insert(0, str(NETGUARD))
import sitecustomize  # noqa: E402,F401  (installs the guard in this process)
