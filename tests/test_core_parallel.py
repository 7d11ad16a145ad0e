"""Behaviours of the loop's data-parallel files that mutation testing found unguarded (docs/mutation.md).

``ddp.py`` (the compression hook, ``no_sync`` during accumulation, the epoch's shuffle) and
``accelerator.py`` (the loop's Accelerate backend), checked in one process: a one-process gloo group
wraps a real ``DistributedDataParallel``, whose all-reduce of one rank returns the gradient itself, so
what the hook and ``no_sync`` do to it shows in the gradient's value.
"""

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from course_lib.training import accelerator
from course_lib.training.accelerator import (
    AcceleratorSteps,
    amp_is_active,
    fresh_accelerator,
    reset_accelerate_state,
)
from course_lib.training.ddp import register_comm_hook, set_epoch, sync_gradients
from course_lib.training.history import History

# fp16 keeps 1.004 as 1.00390625 (10 mantissa bits); bf16 (7 bits) and fp32 do not round it so
X = torch.tensor([[1.004, 3.14159, 2.71828]])
FP16 = X.half().float()


def _ddp() -> DistributedDataParallel:
    linear = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    return DistributedDataParallel(linear)


def _gradient(model, context=None) -> torch.Tensor:
    """The weight's gradient of ``sum(model(X))`` (which is X), after DDP's communication, if any."""
    model.module.weight.grad = None
    with context or sync_gradients(model, True):
        model(X).sum().backward()
    return model.module.weight.grad


# ----------------------------------------------------------------------------------------------
# ddp.py


def test_the_fp16_hook_sends_gradients_in_fp16(group):
    plain, compressed, default = _ddp(), _ddp(), _ddp()
    register_comm_hook(plain, "none")  # DDP's own fp32 all-reduce
    register_comm_hook(default)  # the default: the same
    torch.testing.assert_close(_gradient(default), X, rtol=0, atol=0)
    register_comm_hook(compressed, "fp16")
    torch.testing.assert_close(_gradient(plain), X, rtol=0, atol=0)
    torch.testing.assert_close(_gradient(compressed), FP16, rtol=0, atol=0)
    assert not torch.equal(FP16, X)


def test_the_bf16_hook_is_refused_on_gloo_saying_what_to_use(group):
    with pytest.raises(ValueError, match=r"NCCL backend \(GPUs\) only; this run uses gloo") as raised:
        register_comm_hook(_ddp(), "bf16")
    assert "Use --comm-hook fp16" in str(raised.value)


@pytest.mark.parametrize("available", [True, False])
def test_the_bf16_refusal_reports_whether_this_build_has_nccl(group, monkeypatch, available):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: available)
    with pytest.raises(ValueError) as raised:
        register_comm_hook(_ddp(), "bf16")
    assert ("NCCL available." if available else "NCCL not available.") in str(raised.value)


def test_on_nccl_the_bf16_hook_is_handed_to_ddp(group, monkeypatch):
    """With the NCCL backend (GPUs) the course passes DDP its bf16 hook; this CPU build's DDP then refuses
    the hook itself, which shows that bf16 (not fp16) compression was asked for."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda *args: "nccl")
    if torch.cuda.is_available():
        pytest.skip("a CUDA build accepts the bf16 hook: the refusal this test reads is a CPU build's")
    with pytest.raises(TypeError, match="BF16 all reduce communication hook required CUDA"):
        register_comm_hook(_ddp(), "bf16")
    register_comm_hook(_ddp(), "fp16")  # fp16 is accepted on any backend and build


def test_a_hook_on_a_model_without_ddp_does_nothing_and_an_unknown_one_is_refused():
    model = torch.nn.Linear(3, 1)
    register_comm_hook(model, "fp16")  # one process, no DDP: nothing to compress, no error
    register_comm_hook(model, "bf16")  # nor a backend to ask about
    with pytest.raises(ValueError, match=r"Unknown comm hook 'int8': use one of none, fp16, bf16"):
        register_comm_hook(model, "int8")
    with pytest.raises(ValueError, match="Unknown comm hook"):
        register_comm_hook(_FakeModel(), "int8")


class _FakeModel:
    pass


def test_mid_window_backwards_skip_ddp_s_communication(group):
    """Within an accumulation window (update=False) DDP sends nothing: the fp16 hook does not touch the
    gradient; the window's last backward (update=True) all-reduces it, through the hook."""
    model = _ddp()
    register_comm_hook(model, "fp16")
    torch.testing.assert_close(_gradient(model, sync_gradients(model, False)), X, rtol=0, atol=0)
    assert model.require_backward_grad_sync  # communication is back on after the window's micro-batch
    torch.testing.assert_close(_gradient(model, sync_gradients(model, True)), FP16, rtol=0, atol=0)


class _Fsdp:
    """FSDP2's switch, recorded: ``set_requires_gradient_sync(flag)``."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.calls.append(flag)


def test_mid_window_backwards_under_fsdp_turn_the_reduce_scatter_off_and_on_again():
    model = _Fsdp()
    with sync_gradients(model, False):
        assert model.calls == [False]
    assert model.calls == [False, True]
    with pytest.raises(RuntimeError), sync_gradients(model, False):
        raise RuntimeError("a backward that fails")
    assert model.calls == [False, True, False, True]  # on again even after an error
    with sync_gradients(model, True):
        pass
    assert model.calls == [False, True, False, True]  # the window's last backward: left on


def test_a_model_that_is_not_parallel_has_nothing_to_turn_off():
    with sync_gradients(torch.nn.Linear(2, 2), False):
        pass


class _Sampler:
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


@pytest.mark.parametrize("where", ["sampler", "batch_sampler"])
def test_set_epoch_reaches_the_sampler_that_shuffles(where):
    shuffler = _Sampler()
    loader = SimpleNamespace(**{"sampler": object(), "batch_sampler": object(), where: shuffler})
    set_epoch(loader, 3)
    set_epoch(loader, 4)
    assert shuffler.epochs == [3, 4]


def test_set_epoch_ignores_a_loader_without_samplers():
    set_epoch([{"input_ids": torch.ones(1)}], 2)  # a list of batches: nothing to tell


# ----------------------------------------------------------------------------------------------
# accelerator.py


class _Recorder:
    """An Accelerator of one process that records what the backend asks of it."""

    device, mixed_precision, is_main_process, scaler = torch.device("cpu"), "bf16", False, None

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prepare(self, *objects):
        self.calls.append(("prepare", *objects))
        prepared = tuple(("prepared", o) for o in objects)
        return prepared if len(prepared) > 1 else prepared[0]

    def prepare_model(self, model, evaluation_mode=False):
        self.calls.append(("prepare_model", model, evaluation_mode))
        return ("prepared", model)

    def backward(self, loss):
        self.calls.append(("backward", loss))

    def unscale_gradients(self, optimizer):
        self.calls.append(("unscale_gradients", optimizer))


def test_the_accelerate_backend_takes_its_device_precision_and_rank_from_the_accelerator():
    steps = AcceleratorSteps(_Recorder())
    assert (steps.device, steps.precision, steps.is_main_process) == (torch.device("cpu"), "bf16", False)


def test_the_accelerate_backend_prepares_the_model_optimizer_and_both_loaders():
    acc = _Recorder()
    model, optimizer, train_dl, eval_dl = torch.nn.Linear(2, 2), "opt", "train", "eval"
    got = AcceleratorSteps(acc).prepare(model, optimizer, train_dl, eval_dl)
    assert got == (("prepared", model), ("prepared", "opt"), ("prepared", "train"), ("prepared", "eval"))
    assert acc.calls == [("prepare", model, "opt", "train"), ("prepare", "eval")]
    acc.calls.clear()
    got = AcceleratorSteps(acc).prepare(model, optimizer, train_dl, None)
    assert got[3] is None and acc.calls == [("prepare", model, "opt", "train")]


def test_a_model_an_fsdp_accelerator_shards_goes_through_prepare(group):
    """An Accelerator with an FSDP plugin shards (and wraps) in prepare itself: the loop hands it all."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    acc = _Recorder()
    acc.distributed_type = DistributedType.FSDP
    AcceleratorSteps(acc).prepare(model, "opt", "train", None)
    assert acc.calls == [("prepare", model, "opt", "train")]


def test_a_model_the_loop_sharded_is_prepared_for_autocast_only(group):
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    acc = _Recorder()
    got = AcceleratorSteps(acc).prepare(model, "opt", "train", "eval")
    assert got == (("prepared", model), ("prepared", "opt"), ("prepared", "train"), ("prepared", "eval"))
    assert acc.calls == [
        ("prepare_model", model, True),  # evaluation_mode: no DDP around the shards
        ("prepare", "opt", "train"),
        ("prepare", "eval"),
    ]


def test_the_accelerate_backend_leaves_placement_and_autocast_to_the_prepared_objects():
    acc = _Recorder()
    steps = AcceleratorSteps(acc)
    batch = {"input_ids": torch.ones(2)}
    assert steps.to_device(batch) is batch
    with steps.autocast():
        assert not torch.is_autocast_enabled("cpu")
    loss = torch.tensor(1.0)
    steps.backward(loss)
    steps.unscale("opt")
    assert acc.calls == [("backward", loss), ("unscale_gradients", "opt")]
    assert steps.eval_args() == {"accelerator": acc}


def test_a_disabled_scaler_records_nothing():
    acc = _Recorder()
    acc.scaler = torch.amp.GradScaler("cpu", enabled=False)
    history = History(config={})
    optimizer = SimpleNamespace(step=lambda: None, step_was_skipped=True)
    AcceleratorSteps(acc).step(optimizer, history)
    assert history.scaler_scales == [] and history.skipped_steps == 0


def test_reset_forgets_the_accelerator_state_and_the_process_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    fresh_accelerator(cpu=True, mixed_precision="bf16")
    assert AcceleratorState._shared_state and PartialState._shared_state
    reset_accelerate_state()
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state == {}
    assert GradientState._shared_state == {}


def test_fresh_accelerator_warns_for_fp16_on_a_cpu_only():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bf16 = fresh_accelerator(cpu=True, mixed_precision="bf16")
    assert bf16.mixed_precision == "bf16" and amp_is_active(bf16)
    with pytest.warns(UserWarning, match=r"on a CPU does nothing.*Use mixed_precision='bf16' on a CPU"):
        fp16 = fresh_accelerator(cpu=True, mixed_precision="fp16")
    assert not amp_is_active(fp16)
    reset_accelerate_state()


def test_the_fp16_on_cpu_warning_points_at_the_caller_s_line(monkeypatch):
    # Where fresh_accelerator was called from, read off the stack by a spy on the first function it
    # calls: the frame above fresh_accelerator's, so the check also holds where fresh_accelerator is
    # wrapped (mutmut's trampoline is such a wrapper).
    callers = []
    real = accelerator.reset_accelerate_state

    def spy():
        frame = sys._getframe(2)  # 0: this spy, 1: fresh_accelerator, 2: whoever called it
        callers.append((frame.f_code.co_filename, frame.f_lineno))
        real()

    monkeypatch.setattr(accelerator, "reset_accelerate_state", spy)
    with pytest.warns(UserWarning, match="on a CPU does nothing") as seen:
        fresh_accelerator(cpu=True, mixed_precision="fp16")
    assert [(w.filename, w.lineno) for w in seen] == callers
    if "mutants" not in Path(accelerator.__file__).parts:
        assert callers[0][0] == __file__
    reset_accelerate_state()


def test_amp_is_active_only_where_the_accelerator_autocasts():
    assert not amp_is_active(SimpleNamespace(native_amp=False, mixed_precision="bf16"))
    assert not amp_is_active(SimpleNamespace(native_amp=True, mixed_precision="no"))
    assert not amp_is_active(SimpleNamespace(mixed_precision="bf16"))  # an Accelerator without the flag
    assert amp_is_active(SimpleNamespace(native_amp=True, mixed_precision="fp16"))
