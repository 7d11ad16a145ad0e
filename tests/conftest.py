"""Fixtures shared by several test files (the tiers and the offline switches: the root conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """One two-process DDP run of ``python -m course_lib.cli.train`` (test_train_cli.DDP_STEPS): its
    completed process and output folder. test_train_cli resumes it and compresses its gradients;
    test_train_fsdp compares FSDP with it. Each launch costs about 10 s on 2 cores: it runs once."""
    from test_train_cli import DDP_STEPS, _ok, _run

    base = tmp_path_factory.mktemp("ddp")
    proc = _run([*DDP_STEPS, "--output-dir", str(base / "full")], base, processes=2)
    _ok(proc)
    return proc, base / "full"


@pytest.fixture
def group(tmp_path):
    """A one-process gloo process group for the test, destroyed afterwards."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "an earlier test left its process group behind: destroy it in a finally"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
