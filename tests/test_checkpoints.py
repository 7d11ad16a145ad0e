"""Checkpoints (course_lib.checkpoints): how many are kept, and that saving a step again loses nothing."""

import pytest
import torch

from course_lib import checkpoints


class OneProcess:
    """What ``save_checkpoint`` uses of an ``Accelerator``: one CPU process, no loss scaler."""

    device, num_processes, process_index, is_main_process, scaler = torch.device("cpu"), 1, 0, True, None

    def wait_for_everyone(self) -> None:
        pass


@pytest.fixture
def run(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "gather_object", lambda obj: obj)  # one process: itself
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_only_the_newest_keep_checkpoints_stay(tmp_path, run):
    for step in (1, 2, 3):
        checkpoints.save_checkpoint(tmp_path, step, *run, OneProcess(), {}, keep=2)
    assert [step for step, _ in checkpoints.list_checkpoints(tmp_path)] == [2, 3]
    with pytest.raises(ValueError, match="keep must be >= 1"):  # 0 would have kept every one
        checkpoints.save_checkpoint(tmp_path, 4, *run, OneProcess(), {}, keep=0)


def test_saving_a_step_again_replaces_it_and_leaves_no_temporary_folder(tmp_path, run):
    model, optimizer = run
    checkpoints.save_checkpoint(tmp_path, 5, model, optimizer, OneProcess(), {})
    with torch.no_grad():
        model.weight.fill_(2.0)
    path = checkpoints.save_checkpoint(tmp_path, 5, model, optimizer, OneProcess(), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no .tmp- or .old- folder left
    fresh = torch.nn.Linear(3, 2)
    assert (
        checkpoints.load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), OneProcess())
        == 5
    )
    assert torch.equal(fresh.weight, torch.full((2, 3), 2.0))
