"""Behaviours of the training loop (``training/loop.py``) that mutation testing found unguarded
(docs/mutation.md): what ``TrainConfig`` accepts and refuses (at each boundary), its defaults, and what
``train`` records and calls for a run, on a model whose steps take microseconds.

tests/test_core_training.py holds the loop's evaluation, schedule and resume positions; this file the rest.
"""

import math
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

# torch._dynamo imported at collection: a run's first step imports it (seconds), and mutmut's fork server
# collects once, so each mutant's run does not pay that again
import pytest
import torch
import torch._dynamo  # noqa: F401

from course_lib import training
from course_lib.devices import get_device
from course_lib.training import loop as loop_module
from course_lib.training.accelerator import reset_accelerate_state

# ----------------------------------------------------------------------------------------------
# TrainConfig


def test_the_defaults_are_the_ones_the_lessons_document():
    assert asdict(training.TrainConfig()) == {
        "epochs": 1,
        "max_steps": None,
        "lr": 5e-4,
        "weight_decay": 0.01,
        "warmup_ratio": 0.1,
        "precision": "no",
        "grad_accum_steps": 1,
        "max_grad_norm": 1.0,
        "seed": 0,
        "device": None,
        "progress": True,
        "eval_every_epoch": True,
        "optimizer": "adamw",
        "gradient_checkpointing": False,
        "local_sgd_steps": None,
        "comm_hook": "none",
        "fused_optimizer": None,
        "attn_implementation": None,
        "compile": False,
        "compile_dynamic": None,
        "fsdp": False,
    }


REFUSED = [
    ({"optimizer": "sgd"}, r"optimizer must be one of adamw, adafactor, adamw8bit, got 'sgd'"),
    ({"comm_hook": "int8"}, r"comm_hook must be one of none, fp16, bf16, got 'int8'"),
    ({"local_sgd_steps": 0}, r"local_sgd_steps must be >= 1 \(or None\), got 0"),
    ({"local_sgd_steps": 4, "comm_hook": "fp16"}, r"comm_hook compresses DDP's per-step gradient all-reduce"),
    ({"max_steps": 0}, r"max_steps must be >= 1 \(or None: all epochs\), got 0"),
    ({"max_grad_norm": 0.0}, r"max_grad_norm must be positive \(or None: no clipping\), got 0.0"),
    ({"max_grad_norm": -1.0}, r"max_grad_norm must be positive"),
    ({"weight_decay": -0.01}, r"weight_decay must be >= 0 and warmup_ratio in \[0, 1\), got -0.01 and 0.1"),
    ({"warmup_ratio": 1.0}, r"weight_decay must be >= 0 and warmup_ratio in \[0, 1\), got 0.01 and 1.0"),
    ({"warmup_ratio": -0.1}, r"warmup_ratio in \[0, 1\)"),
    ({"fused_optimizer": True, "optimizer": "adafactor"}, r"fused_optimizer applies to optimizer adamw only"),
    (
        {"fused_optimizer": False, "optimizer": "adamw8bit"},
        r"fused_optimizer applies to optimizer adamw only",
    ),
    ({"grad_accum_steps": 0}, r"grad_accum_steps must be >= 1, got 0"),
    ({"epochs": 0}, r"Set epochs >= 1 or max_steps >= 1: there is nothing to train"),
    ({"lr": 0.0}, r"lr must be positive, got 0.0"),
    ({"lr": -1e-3}, r"lr must be positive"),
    ({"fsdp": True, "local_sgd_steps": 2}, r"fsdp shards the model and reduce-scatters its gradients"),
    ({"fsdp": True, "comm_hook": "fp16"}, r"fsdp shards the model and reduce-scatters its gradients"),
    ({"fsdp": True, "optimizer": "adafactor"}, r"fsdp runs with optimizer adamw only: .*'adafactor' raises"),
    (
        {"attn_implementation": "flash"},
        r"attn_implementation must be one of eager, sdpa \(or None\), got 'flash'",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED, ids=[str(k) for k, _ in REFUSED])
def test_a_config_that_cannot_run_is_refused_saying_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training.TrainConfig(**kwargs)


ACCEPTED = [
    {"local_sgd_steps": 1},  # the smallest period
    {"local_sgd_steps": 2, "comm_hook": "none"},
    {"comm_hook": "fp16"},
    {"max_steps": 1},
    {"max_grad_norm": 1e-6},
    {"max_grad_norm": None},
    {"weight_decay": 0.0, "warmup_ratio": 0.0},
    {"warmup_ratio": 0.99},
    {"fused_optimizer": False},
    {"fused_optimizer": True, "optimizer": "adamw"},
    {"optimizer": "adafactor"},
    {"grad_accum_steps": 1},
    {"epochs": 0, "max_steps": 3},  # steps alone decide
    {"lr": 1e-9},
    {"fsdp": True},
    {"attn_implementation": "eager"},
    {"attn_implementation": "sdpa"},
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=[str(k) for k in ACCEPTED])
def test_a_config_at_each_boundary_is_accepted(kwargs):
    config = training.TrainConfig(**kwargs)
    assert {k: getattr(config, k) for k in kwargs} == kwargs


# ----------------------------------------------------------------------------------------------
# train: what a run records


class Noisy(torch.nn.Module):
    """``model(**batch)``: logits ``x @ w`` plus noise from torch's RNG (as dropout draws), so a run
    depends on the RNG state it starts from; records each forward's mode."""

    def __init__(self, noise: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.linear = torch.nn.Linear(4, 2)
        self.noise = noise
        self.modes: list[bool] = []

    def forward(self, input_ids, labels):
        self.modes.append(self.training)
        logits = self.linear(input_ids) + self.noise * torch.randn(len(input_ids), 2)
        return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits, labels))


def _batches(n: int, size: int = 2, length: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [
        {
            "input_ids": torch.randn(size, length, generator=g),
            "labels": torch.randint(0, 2, (size,), generator=g),
        }
        for _ in range(n)
    ]


def _config(**kwargs) -> training.TrainConfig:
    return training.TrainConfig(
        **{
            "lr": 1e-2,
            "warmup_ratio": 0.0,
            "progress": False,
            "device": "cpu",
            "max_grad_norm": None,
            **kwargs,
        }
    )


def test_a_fresh_run_seeds_itself_and_a_resumed_one_keeps_the_rng_it_was_given():
    def losses(start_step, rng_seed, seed=0):
        model = Noisy(noise=1.0)
        torch.manual_seed(rng_seed)  # the caller's RNG state (a resumed run's is restored from a checkpoint)
        history = training.train(model, _batches(4), _config(seed=seed), start_step=start_step)
        return history.losses

    assert losses(0, 1) == losses(0, 2)  # seeded from config.seed: the caller's state does not matter
    assert losses(0, 1) != losses(0, 1, seed=5)
    assert losses(1, 1) != losses(1, 2)  # resumed: the caller's (restored) state rules


def test_a_run_records_its_precision_device_and_config():
    history = training.train(Noisy(), _batches(2), _config(seed=3))
    assert history.config["precision"] == "no" and history.config["device"] == "cpu"
    assert history.config["seed"] == 3 and history.config["lr"] == 1e-2


def test_each_step_records_the_window_mean_loss_its_tokens_and_its_time():
    """k=2 over 5 batches of 2 rows of 4 tokens: windows of 2, 2 and 1 micro-batches."""
    batches = _batches(5, size=2)
    model = Noisy().eval()
    history = training.train(model, batches, _config(grad_accum_steps=2, lr=1e-12))
    assert model.modes == [True] * 5  # the loop trains in training mode, whatever mode it was given
    assert history.step_tokens == [16, 16, 8]  # input_ids elements per step
    assert len(history.step_times) == 3 and all(t >= 0 for t in history.step_times)
    with torch.no_grad():  # lr ~ 0: the weights stay put, so the losses can be recomputed
        single = [model(**b).loss.item() for b in batches]
    expected = [(single[0] + single[1]) / 2, (single[2] + single[3]) / 2, single[4]]
    assert history.losses == pytest.approx(expected, rel=1e-5)


def test_a_batch_without_input_ids_counts_its_examples():
    class Images(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, pixel_values, labels):
            return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.linear(pixel_values), labels))

    batches = [{"pixel_values": torch.randn(3, 4), "labels": torch.tensor([0, 1, 0])}] * 2
    assert training.train(Images(), batches, _config()).step_tokens == [3, 3]


def test_clipping_records_one_norm_per_step_and_none_without_it():
    assert len(training.train(Noisy(), _batches(3), _config(max_grad_norm=1.0)).grad_norms) == 3
    assert training.train(Noisy(), _batches(3), _config()).grad_norms == []


def test_the_gradients_are_freed_after_each_step():
    model = Noisy()
    training.train(model, _batches(2), _config())
    assert all(p.grad is None for p in model.parameters())


def test_evaluation_runs_after_each_epoch_when_asked():
    evals = _batches(1)
    history = training.train(Noisy(), _batches(2), _config(epochs=3), eval_dataloader=evals)
    assert [e["step"] for e in history.evals] == [2, 4, 6]
    assert {"accuracy", "f1", "loss"} <= set(history.evals[0])
    off = training.train(
        Noisy(), _batches(2), _config(epochs=3, eval_every_epoch=False), eval_dataloader=evals
    )
    assert off.evals == []
    assert training.train(Noisy(), _batches(2), _config(epochs=3)).evals == []


def test_on_step_sees_every_step_and_true_stops_the_run_there():
    seen = []
    history = training.train(
        Noisy(), _batches(4), _config(epochs=2), on_step=lambda s: seen.append(s) or s == 5
    )
    assert seen == [1, 2, 3, 4, 5] and len(history.losses) == 5
    seen.clear()
    history = training.train(Noisy(), _batches(4), _config(epochs=2), on_step=seen.append)
    assert seen == list(range(1, 9)) and len(history.losses) == 8


def test_max_steps_ends_a_run_mid_epoch_and_evaluates_where_it_stopped():
    history = training.train(
        Noisy(), _batches(4), _config(epochs=3, max_steps=6), eval_dataloader=_batches(1)
    )
    assert len(history.losses) == 6
    assert [e["step"] for e in history.evals] == [4, 6]


class Loader(list):
    """A list of batches whose sampler records ``set_epoch`` (as a DistributedSampler)."""

    def __init__(self, batches):
        super().__init__(batches)
        self.sampler = SimpleNamespace(epochs=[])
        self.sampler.set_epoch = self.sampler.epochs.append


@pytest.mark.parametrize(("start_step", "epochs"), [(0, [0, 1, 2]), (3, [1, 2]), (8, [2])])
def test_each_epoch_tells_the_sampler_its_number(start_step, epochs):
    loader = Loader(_batches(3))
    training.train(Noisy(), loader, _config(epochs=3), start_step=start_step)
    assert loader.sampler.epochs == epochs


def test_non_finite_losses_are_flagged():
    batches = [{"input_ids": torch.full((2, 4), float("inf")), "labels": torch.tensor([0, 1])}]
    with pytest.warns(UserWarning, match="Some training losses were not finite: lower lr"):
        history = training.train(Noisy(), batches, _config())
    assert not math.isfinite(history.losses[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        training.train(Noisy(), _batches(2), _config())


def test_an_empty_loader_is_refused():
    with pytest.raises(ValueError, match="The training DataLoader is empty: there is nothing to train on"):
        training.train(Noisy(), [], _config())


def test_the_progress_bar_counts_the_steps_of_the_whole_run(capsys):
    training.train(Noisy(), _batches(4), _config(progress=True, epochs=2), start_step=3)
    err = capsys.readouterr().err
    assert "train (no)" in err and "8/8" in err  # resumed at 3, ends at the run's last step
    training.train(Noisy(), _batches(4), _config(epochs=2))
    assert capsys.readouterr().err == ""  # progress=False: no bar


# ----------------------------------------------------------------------------------------------
# train: the switches reach the techniques


class Switchable(Noisy):
    """Records the attention implementation asked for."""

    def set_attn_implementation(self, implementation):
        self.implementation = implementation


def test_the_attention_switch_reaches_the_model():
    model = Switchable()
    training.train(model, _batches(1), _config(attn_implementation="eager"))
    assert model.implementation == "eager"
    untouched = Switchable()
    training.train(untouched, _batches(1), _config())
    assert not hasattr(untouched, "implementation")


def test_gradient_checkpointing_is_asked_of_the_model():
    with pytest.raises(ValueError, match="Noisy does not support gradient checkpointing"):
        training.train(Noisy(), _batches(1), _config(gradient_checkpointing=True))


@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_trains_through_the_compiled_forward(monkeypatch, dynamic):
    """torch.compile is watched (compiling takes far longer than this run): the loop must call what it
    returned, with the dynamic setting asked for, while the model's own parameters train."""
    calls = []

    def fake_compile(model, dynamic=None):
        def forward(**batch):
            calls.append(dynamic)
            return model(**batch)

        return forward

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = Noisy()
    before = model.linear.weight.detach().clone()
    training.train(model, _batches(2), _config(compile=True, compile_dynamic=dynamic))
    assert calls == [dynamic, dynamic]
    assert not torch.equal(before, model.linear.weight)
    calls.clear()
    training.train(Noisy(), _batches(2), _config())
    assert calls == []


def test_an_accelerator_run_takes_its_precision_and_device_from_the_accelerator():
    accelerator = training.fresh_accelerator(cpu=True, mixed_precision="bf16")
    try:
        history = training.train(Noisy(), _batches(2), _config(), accelerator=accelerator)
    finally:
        reset_accelerate_state()
    assert history.config["precision"] == "bf16" and history.config["device"] == "cpu"
    assert len(history.losses) == 2


def test_build_optimizer_follows_the_config():
    model = Noisy()
    adamw = training.build_optimizer(model, _config(lr=3e-3, weight_decay=0.2))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["lr"] == 3e-3
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.2, 0.0]
    assert adamw.defaults["fused"] is True  # None: fused where torch has it (the CPU does, in torch 2.13)
    assert not training.build_optimizer(model, _config(fused_optimizer=False)).defaults["fused"]
    assert type(training.build_optimizer(model, _config(optimizer="adafactor"))).__name__ == "Adafactor"


def test_fsdp_with_an_optimizer_made_before_sharding_is_refused():
    model = Noisy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fsdp with an optimizer passed in"):
        training.train(model, _batches(1), _config(fsdp=True), optimizer=optimizer)


# ----------------------------------------------------------------------------------------------
# train: what it hands the techniques, on the backends where they act


class Recording(Noisy):
    """Records DDP's calls (``no_sync``, ``register_comm_hook``) and each forward's autocast dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.no_syncs, self.hooks, self.dtypes = 0, [], []

    @contextmanager
    def no_sync(self):
        self.no_syncs += 1
        yield

    def register_comm_hook(self, state, hook):
        self.hooks.append(hook.__name__)

    def forward(self, input_ids, labels):
        out = super().forward(input_ids, labels)
        self.dtypes.append(self.linear(input_ids).dtype)
        return out


def test_the_comm_hook_asked_for_reaches_a_ddp_model():
    model = Recording()
    training.train(model, _batches(1), _config(comm_hook="fp16"))
    assert model.hooks == ["fp16_compress_hook"]
    training.train(model, _batches(1), _config())
    assert model.hooks == ["fp16_compress_hook"]  # "none": DDP's own all-reduce, no hook


def test_ddp_communicates_only_in_each_window_s_last_backward():
    model = Recording()
    training.train(model, _batches(7), _config(grad_accum_steps=3))  # windows 3, 3, 1
    assert model.no_syncs == 2 + 2 + 0


def test_a_bf16_run_trains_and_evaluates_under_bf16_autocast():
    model = Recording()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without native bf16 warns: not what this test checks
        history = training.train(model, _batches(2), _config(precision="bf16"), eval_dataloader=_batches(1))
    assert history.config["precision"] == "bf16"
    assert set(model.dtypes) == {torch.bfloat16}  # 2 training forwards and 1 evaluation forward
    assert len(model.dtypes) == 3


@pytest.mark.filterwarnings("ignore:fp16 on a CPU is a trap")
def test_an_fp16_run_steps_through_the_scaler_and_clips_the_true_gradients():
    history = training.train(Noisy(), _batches(3), _config(precision="fp16", max_grad_norm=1.0))
    assert len(history.scaler_scales) == 3  # the GradScaler's state recorded each step
    assert all(isinstance(n, float) and 0 < n < 1e3 for n in history.grad_norms)  # unscaled: not x65536


def test_the_precision_is_judged_for_the_device_the_run_uses(monkeypatch):
    """fp16 on a CPU warns even when a GPU is present (faked here) and the config asks for the CPU."""
    from course_lib.mixed_precision import PrecisionWarning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(PrecisionWarning, match="fp16 on a CPU is a trap"):
        training.train(Noisy(), _batches(1), _config(precision="fp16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA trains there")
def test_the_device_asked_for_is_the_one_used():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        training.train(Noisy(), _batches(1), _config(device="cuda"))
    history = training.train(Noisy(), _batches(1), _config(device=None))
    assert history.config["device"] == str(get_device(None))


def test_a_run_resumed_at_its_last_step_trains_no_more():
    history = training.train(
        Noisy(), _batches(4), _config(epochs=2), start_step=8, eval_dataloader=_batches(1)
    )
    assert history.losses == [] and history.evals == []


def test_stopping_early_at_an_epoch_s_end_ends_the_run():
    history = training.train(Noisy(), _batches(2), _config(epochs=3), on_step=lambda s: s == 2)
    assert len(history.losses) == 2


def test_the_progress_bar_redraws_a_bounded_number_of_times_and_shows_the_loss(capsys, monkeypatch):
    """A bar that redraws every step sends a message per step (in a notebook, a kernel message each):
    the loop asks tqdm for at most about PROGRESS_REDRAWS redraws, at least PROGRESS_INTERVAL apart, and
    no reset of that pacing by tqdm's monitor thread (maxinterval=inf)."""
    from course_lib.training import loop

    asked = []
    real = loop.tqdm

    def watched(*args, **kwargs):
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "tqdm", watched)
    monkeypatch.setattr(loop, "PROGRESS_INTERVAL", 0.0)  # pace by count only, so the count shows
    history = training.train(Noisy(), _batches(100, size=1), _config(progress=True), start_step=20)
    (kwargs,) = asked
    assert kwargs["miniters"] == math.ceil(80 / loop.PROGRESS_REDRAWS)
    assert kwargs["mininterval"] == 0.0 and kwargs["maxinterval"] == float("inf")
    err = capsys.readouterr().err
    assert err.count("\r") <= loop.PROGRESS_REDRAWS + 3  # about one redraw per 4 of the 80 steps
    assert f"loss={history.losses[-1]:.3f}" in err
    training.train(Noisy(), _batches(10, size=1), _config(progress=True))
    assert asked[-1]["miniters"] == 1  # a short run redraws at every step


class Stacked(Noisy):
    """Two blocks in a ModuleList (what FSDP shards one by one) before the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, input_ids, labels):
        from transformers.modeling_outputs import SequenceClassifierOutput

        for block in self.blocks:
            input_ids = block(input_ids)
        logits = self.linear(input_ids)
        # a ModelOutput, as a transformers model returns: FSDP2 finds its tensors to hook the backward on
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class LocalSgdAccelerator:
    """An Accelerator of several CPU processes, for the loop: prepare hands back what it gets, and
    LocalSGD's averaging (``wait_for_everyone``, then a mean per parameter) is recorded per step."""

    device, mixed_precision, is_main_process, scaler = torch.device("cpu"), "no", True, None

    def __init__(self, distributed_type="MULTI_CPU") -> None:
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType(distributed_type)
        self.averaged_at: list[int] = []
        self.steps = 0
        self.prepared = None

    def prepare(self, *objects):
        self.prepared = objects
        return objects if len(objects) > 1 else objects[0]

    def backward(self, loss):
        loss.backward()

    def wait_for_everyone(self):
        self.averaged_at.append(self.steps)

    def autocast(self):
        return nullcontext()

    def reduce(self, tensor, reduction):
        return tensor


@pytest.mark.parametrize("start_step", [0, 1])
def test_local_sgd_averages_on_the_run_s_schedule(start_step):
    """5 steps with local_sgd_steps=2: averaged within steps 2 and 4 (after the step, before on_step
    records it: the accelerator still reads 1 and 3) and once more as the block closes after step 5; a
    run resumed after step 1 keeps the schedule of the whole run."""
    accelerator = LocalSgdAccelerator()
    accelerator.steps = start_step
    model = Recording()
    training.train(
        model,
        _batches(5),
        _config(local_sgd_steps=2),
        accelerator=accelerator,
        start_step=start_step,
        on_step=lambda s: setattr(accelerator, "steps", s),
    )
    assert accelerator.averaged_at == [1, 3, 5]


def test_an_accelerator_that_shards_is_left_to_shard(group):
    """An FSDP Accelerator shards in prepare: the loop neither shards the model nor refuses its optimizer."""
    from course_lib.training.fsdp import is_sharded

    accelerator = LocalSgdAccelerator("FSDP")
    model = Noisy()
    training.train(model, _batches(1), _config(fsdp=True), accelerator=accelerator)
    assert not is_sharded(model) and accelerator.prepared[0] is model
    other = Noisy()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    training.train(other, _batches(1), _config(fsdp=True), accelerator=accelerator, optimizer=optimizer)
    assert not is_sharded(other)


def test_fsdp_shards_the_model_before_building_its_optimizer(group):
    from torch.distributed.tensor import DTensor

    from course_lib.training.fsdp import is_sharded

    model = Stacked()
    optimizer = training.build_optimizer(model, _config(fsdp=True))
    assert is_sharded(model)
    assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


def test_fsdp_under_an_accelerator_shards_on_the_accelerator_s_device(group):
    from course_lib.training.fsdp import is_sharded

    accelerator = SimpleNamespace(device=torch.device("meta"), distributed_type=None)
    model = Stacked()
    training.build_optimizer(model, _config(fsdp=True, fused_optimizer=False), accelerator=accelerator)
    assert is_sharded(model) and model.linear.weight.device.type == "meta"
    plain = Stacked()  # without fsdp the Accelerator's prepare places the model, not build_optimizer
    training.build_optimizer(plain, _config(), accelerator=accelerator)
    assert plain.linear.weight.device.type == "cpu"


def test_a_model_sharded_before_train_trains_with_an_optimizer_built_after(group):
    from course_lib.training.fsdp import shard_model

    model = shard_model(Stacked())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = training.train(model, _batches(2), _config(fsdp=True), optimizer=optimizer)
    assert len(history.losses) == 2


def test_the_non_finite_warning_points_at_the_caller_s_line(monkeypatch):
    # Where train was called from, read off the stack by a spy on the first function it calls: the
    # frame above train's, so the check also holds where train is wrapped (mutmut's trampoline is one).
    callers = []
    real = loop_module.seed_everything

    def spy(seed):
        frame = sys._getframe(2)  # 0: this spy, 1: train, 2: whoever called it
        callers.append((frame.f_code.co_filename, frame.f_lineno))
        return real(seed)

    monkeypatch.setattr(loop_module, "seed_everything", spy)
    batches = [{"input_ids": torch.full((2, 4), float("inf")), "labels": torch.tensor([0, 1])}]
    with pytest.warns(UserWarning, match="not finite") as seen:
        training.train(Noisy(), batches, _config())
    assert [(w.filename, w.lineno) for w in seen] == callers
    if "mutants" not in Path(loop_module.__file__).parts:
        assert callers[0][0] == __file__
