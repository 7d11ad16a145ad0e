"""What a checkpoint gives back (course_lib.checkpoints), found unguarded by mutation testing (docs/mutation.md).

One CPU process stands in for each rank (``Rank``): the gathers return what the test says every rank
sent, so the multi-rank files (RNG state per rank, optimizer state per rank) are written and read back
in this process.
"""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from course_lib import checkpoints
from course_lib.devices import seed_everything


class Rank:
    """What ``save_checkpoint`` / ``load_checkpoint`` use of an ``Accelerator``: rank ``index`` of ``world``."""

    device = torch.device("cpu")

    def __init__(self, index: int = 0, world: int = 1, scaler=None) -> None:
        self.process_index, self.num_processes, self.scaler = index, world, scaler
        self.is_main_process = index == 0
        self.printed: list[str] = []

    def wait_for_everyone(self) -> None:
        pass

    def print(self, text: str) -> None:
        self.printed.append(text)


@pytest.fixture
def gathered(monkeypatch):
    """``gather_object`` returns what this process sent followed by ``others`` (the other ranks')."""
    import accelerate.utils

    others: dict[str, list] = {"rng": [], "optimizer": []}

    def gather(obj):
        kind = "rng" if "cpu" in obj[0] else "optimizer"
        return obj + others[kind]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather)
    return others


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


# ----------------------------------------------------------------------------------------------
# Finding checkpoints


def test_checkpoints_are_listed_by_step_only_when_complete(tmp_path):
    assert checkpoints.list_checkpoints(tmp_path / "missing") == []
    for step in (10, 9, 100):
        folder = checkpoints.checkpoint_dir(tmp_path, step)
        folder.mkdir()
        (folder / "state.json").write_text("{}")
    assert checkpoints.checkpoint_dir(tmp_path, 9).name == "checkpoint-000009"  # sorts by step in a listing
    (tmp_path / "checkpoint-000200").mkdir()  # no state.json: a copy that was cut short
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-x" / "state.json").write_text("{}")
    (tmp_path / "final").mkdir()
    found = checkpoints.list_checkpoints(tmp_path)
    assert found == [(9, tmp_path / "checkpoint-000009"), (10, tmp_path / "checkpoint-000010"),
                     (100, tmp_path / "checkpoint-000100")]  # fmt: skip


def test_resume_finds_the_newest_checkpoint_or_says_what_to_do(tmp_path):
    assert checkpoints.find_resume_checkpoint(None, tmp_path) is None
    assert checkpoints.find_resume_checkpoint("auto", tmp_path) is None  # a first attempt starts at 0
    with pytest.raises(FileNotFoundError, match=r"--resume: no checkpoint in .*Start without --resume"):
        checkpoints.find_resume_checkpoint("latest", tmp_path)
    for step in (3, 7, 12):
        folder = checkpoints.checkpoint_dir(tmp_path, step)
        folder.mkdir()
        (folder / "state.json").write_text("{}")
    newest = checkpoints.checkpoint_dir(tmp_path, 12)
    assert checkpoints.find_resume_checkpoint("latest", tmp_path) == newest
    assert checkpoints.find_resume_checkpoint("auto", tmp_path) == newest
    older = checkpoints.checkpoint_dir(tmp_path, 3)
    assert checkpoints.find_resume_checkpoint(str(older), tmp_path) == older
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoints.find_resume_checkpoint(str(tmp_path), tmp_path)


# ----------------------------------------------------------------------------------------------
# What a checkpoint restores


def test_a_checkpoint_restores_model_optimizer_scaler_step_and_the_random_stream(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # the scale an fp16 run had reached
    torch.manual_seed(7)
    path = checkpoints.save_checkpoint(tmp_path, 4, model, optimizer, Rank(scaler=scaler), {"seed": 0})
    after_save = torch.rand(3)
    assert json.loads((path / "state.json").read_text())["step"] == 4

    fresh, fresh_optimizer = _model_and_optimizer(seed=1)
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.manual_seed(99)
    assert checkpoints.load_checkpoint(path, fresh, fresh_optimizer, Rank(scaler=fresh_scaler)) == 4
    assert torch.equal(torch.rand(3), after_save)  # dropout continues as in the uninterrupted run
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    saved, restored = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for i in saved:
        assert all(torch.equal(saved[i][k], restored[i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert fresh_scaler.get_scale() == 256.0


def test_each_rank_resumes_its_own_random_stream_and_a_new_world_size_a_seeded_one(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    torch.manual_seed(11)
    rank1_state = torch.get_rng_state()
    rank1_next = torch.rand(3)
    gathered["rng"] = [{"cpu": rank1_state}]  # rank 1's RNG state, gathered on rank 0
    torch.manual_seed(5)
    path = checkpoints.save_checkpoint(tmp_path, 6, model, optimizer, Rank(world=2), {"seed": 3})

    as_rank1 = Rank(index=1, world=2)
    checkpoints.load_checkpoint(path, *_model_and_optimizer(), as_rank1)
    assert torch.equal(torch.rand(3), rank1_next) and as_rank1.printed == []

    alone = Rank(world=1)  # written by 2 processes, resumed by 1: a stream from seed + step, and a note
    checkpoints.load_checkpoint(path, *_model_and_optimizer(), alone)
    drawn = torch.rand(3)
    seed_everything(3 + 6)
    assert torch.equal(drawn, torch.rand(3))
    assert len(alone.printed) == 1 and "written by 2 process(es), this run has 1" in alone.printed[0]


def test_local_sgd_ranks_each_resume_their_own_optimizer_state(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    _, other = _model_and_optimizer(seed=2)  # rank 1's optimizer drifted apart (local SGD)
    gathered["optimizer"] = [checkpoints._cpu_state(other)]
    gathered["rng"] = [{"cpu": torch.get_rng_state()}]
    path = checkpoints.save_checkpoint(
        tmp_path, 2, model, optimizer, Rank(world=2), {"seed": 0}, per_rank_optimizer=True
    )
    for index, expected in ((0, optimizer), (1, other)):
        _, fresh = _model_and_optimizer(seed=9)
        checkpoints.load_checkpoint(path, torch.nn.Linear(3, 2), fresh, Rank(index=index, world=2))
        assert torch.equal(
            fresh.state_dict()["state"][0]["exp_avg"], expected.state_dict()["state"][0]["exp_avg"]
        )
    _, fresh = _model_and_optimizer(seed=9)  # another world size: the shared optimizer file
    checkpoints.load_checkpoint(path, torch.nn.Linear(3, 2), fresh, Rank(index=1, world=3))
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_optimizer_state_with_nested_entries_and_numbers_survives_the_file(tmp_path):
    """bitsandbytes keeps a dict per parameter (its quantisation state) beside tensors and numbers."""
    state = {
        "state": {
            0: {
                "step": 3,
                "exp_avg": torch.arange(4.0),
                "qmap": {"absmax": torch.ones(2), "code": torch.zeros(3)},
            },
            1: {"step": 3, "exp_avg.v2": torch.full((2,), 5.0), "lr.scale": 0.5},  # keys with dots
            2: {"qmap": {"code/v2": torch.ones(1)}},  # a nested key holding the separator
        },
        "param_groups": [{"params": [0, 1, 2], "lr": 0.1, "betas": [0.9, 0.999]}],
    }
    path = tmp_path / "optimizer.safetensors"
    checkpoints.save_optimizer_state(state, path)
    back = checkpoints.read_optimizer_state(path)
    assert back["param_groups"] == state["param_groups"]
    assert back["state"].keys() == {0, 1, 2} and back["state"][0]["step"] == 3
    assert back["state"][1]["lr.scale"] == 0.5
    assert list(back["state"][2]["qmap"]) == ["code/v2"]
    assert torch.equal(back["state"][0]["exp_avg"], torch.arange(4.0))
    assert set(back["state"][0]["qmap"]) == {"absmax", "code"}
    assert torch.equal(back["state"][0]["qmap"]["code"], torch.zeros(3))
    assert torch.equal(back["state"][1]["exp_avg.v2"], torch.full((2,), 5.0))


def test_an_fsdp_checkpoint_and_a_ddp_one_refuse_each_other(tmp_path):
    by_name = {
        "state": {"dense.weight": {"step": torch.tensor(1.0)}, "dense.bias": {"step": torch.tensor(2.0)}},
        "param_groups": [{"params": ["dense.weight", "dense.bias"], "lr": 0.1}],
    }
    by_position = checkpoints._by_position(by_name)
    assert by_position["state"] == {0: by_name["state"]["dense.weight"], 1: by_name["state"]["dense.bias"]}
    assert checkpoints._by_name(by_position, tmp_path) == by_name  # the round trip FSDP resumes through
    ddp = {"state": {0: {}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    with pytest.raises(ValueError, match="without --fsdp"):
        checkpoints._by_name(ddp, tmp_path)

    model, optimizer = _model_and_optimizer()
    folder = tmp_path / "checkpoint-000001"
    folder.mkdir()
    from safetensors.torch import save_model

    save_model(model, str(folder / "model.safetensors"))
    checkpoints.save_optimizer_state(
        {"state": {}, "param_groups": [{"params": ["weight", "bias"], "lr": 0.1}]},
        folder / "optimizer.safetensors",
    )
    (folder / "state.json").write_text(json.dumps({"step": 1, "world_size": 1, "scaler": None, "config": {}}))
    with pytest.raises(ValueError, match="resume it with --fsdp"):
        checkpoints.load_checkpoint(folder, model, optimizer, Rank())


def test_a_write_that_fails_leaves_the_previous_checkpoint_whole(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    path = checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, Rank(), {"seed": 0})
    before = sorted(p.name for p in path.iterdir())

    def killed(folder):
        (folder / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints._write_atomically(path, killed)
    assert sorted(p.name for p in path.iterdir()) == before
    assert checkpoints.list_checkpoints(tmp_path) == [(1, path)]


def test_the_final_model_is_a_folder_of_the_model_and_tokenizer(tmp_path):
    class Saves:
        def __init__(self, name):
            self.name = name

        def save_pretrained(self, folder, state_dict=None):
            (folder / self.name).write_text("saved")

    final = checkpoints.save_final_model(tmp_path, Saves("model"), Saves("tokenizer"), Rank())
    assert final == tmp_path / "final"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert sorted(p.name for p in final.iterdir()) == ["model", "tokenizer"]
    assert checkpoints.save_final_model(
        tmp_path / "other", Saves("model"), Saves("tokenizer"), Rank(index=1)
    ) == (tmp_path / "other" / "final")
    assert not (tmp_path / "other").exists()  # only the main process writes


def test_by_default_the_two_newest_checkpoints_stay_and_keep_1_leaves_one(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    for step in (1, 2, 3):
        checkpoints.save_checkpoint(tmp_path / "default", step, model, optimizer, Rank(), {"seed": 0})
        checkpoints.save_checkpoint(tmp_path / "one", step, model, optimizer, Rank(), {"seed": 0}, keep=1)
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path / "default")] == [2, 3]
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path / "one")] == [3]
    # one optimizer file by default: DDP ranks hold the same state
    assert sorted(p.name for p in checkpoints.checkpoint_dir(tmp_path / "one", 3).iterdir()) == [
        "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"
    ]  # fmt: skip


def test_a_checkpoint_goes_into_a_new_output_folder_and_over_what_a_killed_save_left(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    out = tmp_path / "runs" / "train"  # does not exist yet
    final = checkpoints.checkpoint_dir(out, 4)
    out.mkdir(parents=True)
    (out / f".tmp-{final.name}").mkdir()  # a save killed while writing
    (out / f".tmp-{final.name}" / "model.safetensors").write_text("half")
    checkpoints.save_checkpoint(out, 4, model, optimizer, Rank(), {"seed": 0})
    (out / f".old-{final.name}").mkdir()  # a save killed between its two renames
    (out / f".old-{final.name}" / "state.json").write_text("{}")
    checkpoints.save_checkpoint(out, 4, model, optimizer, Rank(), {"seed": 0})
    assert sorted(p.name for p in out.iterdir()) == [final.name]
    fresh, fresh_optimizer = _model_and_optimizer(seed=3)
    checkpoints.load_checkpoint(final, fresh, fresh_optimizer, Rank())
    assert torch.equal(fresh.weight, model.weight)
    nested = tmp_path / "new" / "deeper"
    checkpoints.save_checkpoint(nested, 1, model, optimizer, Rank(), {"seed": 0})
    assert [s for s, _ in checkpoints.list_checkpoints(nested)] == [1]


def test_an_fp16_checkpoint_resumes_in_a_run_without_a_loss_scaler(tmp_path, gathered):
    model, optimizer = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    path = checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, Rank(scaler=scaler), {"seed": 0})
    assert json.loads((path / "state.json").read_text())["scaler"]["scale"] == 256.0
    assert checkpoints.load_checkpoint(path, *_model_and_optimizer(seed=4), Rank(scaler=None)) == 2


def test_other_ranks_optimizer_states_with_numbers_in_them_are_saved(tmp_path, gathered):
    """Rank 1's optimizer keeps a plain number beside a tensor (LBFGS keeps counts, for one)."""
    model, optimizer = _model_and_optimizer()
    counting = {
        "state": {0: {"count": 3, "buf": torch.ones(2)}},
        "param_groups": [{"params": [0], "lr": 0.1}],
    }

    class Counting(torch.optim.SGD):
        def state_dict(self):
            return counting

    gathered["optimizer"] = [checkpoints._cpu_state(Counting(model.parameters(), lr=0.1))]
    gathered["rng"] = [{"cpu": torch.get_rng_state()}]
    path = checkpoints.save_checkpoint(
        tmp_path, 1, model, optimizer, Rank(world=2), {}, per_rank_optimizer=True
    )
    back = checkpoints.read_optimizer_state(path / "optimizer-rank1.safetensors")
    assert back["state"][0]["count"] == 3 and torch.equal(back["state"][0]["buf"], torch.ones(2))


class OnCuda(Rank):
    device = torch.device("cuda")


def test_a_gpu_run_saves_and_restores_each_rank_s_cuda_random_stream(tmp_path, gathered, monkeypatch):
    """The CUDA RNG calls are faked (no GPU needed): what is saved for the device is what is set back."""

    def get_rng_state(device="cuda"):  # the device's own stream: this rank's, not the current device's
        return torch.tensor([1, 2, 3] if device == torch.device("cuda") else [0], dtype=torch.uint8)

    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device=None: restored.append((state, device))
    )
    model, optimizer = _model_and_optimizer()
    assert set(checkpoints.rng_state(torch.device("cuda"))) == {"cpu", "cuda"}
    assert set(checkpoints.rng_state(torch.device("cpu"))) == {"cpu"}
    gathered["rng"] = [{"cpu": torch.get_rng_state(), "cuda": torch.tensor([7, 7], dtype=torch.uint8)}]
    path = checkpoints.save_checkpoint(tmp_path, 3, model, optimizer, OnCuda(world=2), {"seed": 0})
    checkpoints.load_checkpoint(path, *_model_and_optimizer(), OnCuda(index=1, world=2))
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.tensor([7, 7], dtype=torch.uint8))
    assert restored[0][1] == torch.device("cuda")
    checkpoints.load_checkpoint(path, *_model_and_optimizer(), OnCuda(index=0, world=2))
    assert torch.equal(restored[1][0], torch.tensor([1, 2, 3], dtype=torch.uint8))
    checkpoints.load_checkpoint(path, *_model_and_optimizer(), Rank(index=0, world=2))  # resumed on a CPU
    assert len(restored) == 2  # a CPU run leaves the CUDA stream alone


class Blocks(torch.nn.Module):
    """Two blocks in a ModuleList (what ``shard_model`` shards one by one) and a head; saves like HF."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def save_pretrained(self, folder, state_dict=None):
        from safetensors.torch import save_file

        state = self.state_dict() if state_dict is None else state_dict
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state.items()}, str(folder / "model.safetensors")
        )


def _sharded(seed: int):
    from course_lib.training.fsdp import shard_model

    model = shard_model(Blocks(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _full(model) -> dict[str, torch.Tensor]:
    from course_lib.training.fsdp import full_state

    return full_state(model)[0]


def test_an_fsdp_run_checkpoints_its_full_state_and_resumes_it(tmp_path, gathered, group):
    """One process of an FSDP group: the files hold full tensors, keyed as an unsharded model's, and a
    freshly sharded model resumes to the same parameters and optimizer moments."""
    from safetensors.torch import load_file

    model, optimizer = _sharded(seed=0)
    path = checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, Rank(), {"seed": 0})
    saved = load_file(str(path / "model.safetensors"))
    assert saved.keys() == Blocks().state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in _full(model).items())
    by_position = checkpoints.read_optimizer_state(path / "optimizer.safetensors")
    assert sorted(by_position["state"]) == list(range(6))  # 6 tensors, by position as DDP's

    fresh, fresh_optimizer = _sharded(seed=1)
    assert checkpoints.load_checkpoint(path, fresh, fresh_optimizer, Rank()) == 1
    assert all(torch.equal(_full(fresh)[k], v) for k, v in saved.items())
    from course_lib.training.fsdp import full_state

    moments = {k: v["exp_avg"] for k, v in full_state(model, optimizer)[1]["state"].items()}
    restored = {k: v["exp_avg"] for k, v in full_state(fresh, fresh_optimizer)[1]["state"].items()}
    assert moments.keys() == restored.keys() and all(torch.equal(moments[k], restored[k]) for k in moments)

    plain = Blocks(seed=2)  # an FSDP checkpoint into a run without --fsdp: refused, saying so
    with pytest.raises(ValueError, match="resume it with --fsdp"):
        checkpoints.load_checkpoint(path, plain, torch.optim.AdamW(plain.parameters(), lr=0.1), Rank())

    tokenizer = SimpleNamespace(save_pretrained=lambda folder: (folder / "tokenizer.json").write_text("{}"))
    final = checkpoints.save_final_model(tmp_path, model, tokenizer, Rank())  # the full model, unsharded
    assert all(torch.equal(load_file(str(final / "model.safetensors"))[k], v) for k, v in saved.items())


def test_a_ddp_checkpoint_is_refused_by_an_fsdp_run(tmp_path, gathered, group):
    plain = Blocks()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    path = checkpoints.save_checkpoint(tmp_path, 1, plain, optimizer, Rank(), {"seed": 0})
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} holds .* resume it without --fsdp"):
        checkpoints.load_checkpoint(path, *_sharded(seed=0), Rank())
