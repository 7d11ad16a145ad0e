"""Lesson 04's checkpointing apparatus: checkpointing recomputes each layer once, keeps the gradients and
saves fewer bytes; forward and backward timed apart; sqrt(n) on a synthetic stack; model states read from
tensors."""

import copy

import pytest
import test_apparatus_accumulation as accumulation_tests
import torch

from course_lib.apparatus import accumulation_checkpointing as ac
from course_lib.distributed import flat_grads, max_abs_diff
from course_lib.instruments.memory import model_state_bytes, saved_tensor_bytes

TOL = accumulation_tests.TOL
model, batch = accumulation_tests.model, accumulation_tests.batch  # the same module-scoped fixtures


def test_checkpointing_runs_each_layer_twice_and_keeps_the_gradients(model, batch):
    plain = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    n_layers = len(ac.checkpointed_layers(plain))
    assert ac.layer_runs_per_step(plain, batch) == [1] * n_layers
    assert ac.layer_runs_per_step(checkpointed, batch) == [2] * n_layers
    assert ac.compute_ratio(1, 2) == pytest.approx(4 / 3)
    # transformers keeps a layer's own hooks outside the checkpoint: they run once per step.
    calls = []
    handle = ac.checkpointed_layers(checkpointed)[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    checkpointed(**batch).loss.backward()
    handle.remove()
    assert len(calls) == 1
    checkpointed.zero_grad(set_to_none=True)
    checkpointed(**batch).loss.backward()
    plain(**batch).loss.backward()
    assert max_abs_diff(flat_grads(checkpointed), flat_grads(plain)) < TOL
    assert saved_tensor_bytes(lambda: checkpointed(**batch).loss) < 0.5 * saved_tensor_bytes(
        lambda: plain(**batch).loss
    )


def test_layer_runs_removes_its_hooks(model, batch):
    layers = ac.checkpointed_layers(model)
    with ac.LayerRuns(layers) as counter:
        with torch.no_grad():
            model(**batch)
        assert counter.runs() == [1] * len(layers)
    with torch.no_grad():
        model(**batch)
    assert counter.runs() == [1] * len(layers)


def test_sqrt_n_checkpointing_grows_like_sqrt_n():
    table = ac.sqrt_n_rows([4, 16, 64], width=8, batch=32)
    plain = [r["plain"] for r in table]
    ckpt = [r["checkpointed"] for r in table]
    assert [r["segments"] for r in table] == [2, 4, 8]
    # No checkpointing: linear in n (equal steps per block); sqrt(n) segments: doubling per 4x depth.
    assert (plain[2] - plain[1]) == pytest.approx(4 * (plain[1] - plain[0]))
    assert 1.8 < ckpt[1] / ckpt[0] < 2.5 and 1.8 < ckpt[2] / ckpt[1] < 2.5
    assert ckpt[2] < 0.25 * plain[2]


def test_stack_saved_bytes_keeps_one_input_per_checkpointed_segment():
    stack, x = ac.linear_gelu_stack(6, width=8), torch.randn(4, 8)
    plain, two, six = (ac.stack_saved_bytes(stack, x, s) for s in (None, 2, 6))
    assert six < two < plain
    assert all(p.grad is None for p in stack.parameters())  # reset after the backward that frees them


def test_errors_say_what_to_pass():
    stack = ac.linear_gelu_stack(3, width=4)
    with pytest.raises(ValueError, match="segments"):
        ac.stack_saved_bytes(stack, torch.randn(2, 4), segments=4)
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        ac.checkpointed_layers(stack)
    with pytest.raises(ValueError, match="plain_runs"):
        ac.compute_ratio(2, 1)
    assert torch.equal(
        ac.linear_gelu_stack(2, 4, seed=1)[0][0].weight, ac.linear_gelu_stack(2, 4, seed=1)[0][0].weight
    )


def test_time_phases_and_the_predicted_ratio(model, batch):
    plain = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    phases = ac.time_phases({"plain": plain, "checkpointed": checkpointed}, batch, warmup=0, repeat=1)
    for t in phases.values():
        assert t["forward"] > 0 and t["backward"] > 0 and 0 < t["layers forward"] <= t["forward"]
    assert all(p.grad is not None for p in plain.parameters())  # a real backward ran
    assert ac.predicted_ratio(1.0, 2.0, 1.0) == pytest.approx(4 / 3)  # the count's case
    assert ac.predicted_ratio(1.0, 1.0, 0.5) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="layers_forward"):
        ac.predicted_ratio(1.0, 2.0, 1.5)
    with pytest.raises(ValueError, match="repeat"):
        ac.time_phases({"plain": plain}, batch, repeat=0)


def test_model_state_bytes_reads_the_tensors(model, batch):
    work = copy.deepcopy(model)
    n = sum(p.numel() for p in work.parameters())
    assert model_state_bytes(work) == {"weights": 4 * n, "gradients": 0, "optimizer state": 0}
    optimizer = torch.optim.AdamW(work.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = work(**batch).loss
    loss.backward()  # autocast keeps fp32 weights, so the gradients are fp32 too
    optimizer.step()
    assert model_state_bytes(work, optimizer) == {
        "weights": 4 * n,
        "gradients": 4 * n,
        "optimizer state": 8 * n,
    }
    work.half()
    assert model_state_bytes(work)["weights"] == 2 * n  # dtype as it is, not a formula


def test_the_idea_is_drawn_in_two_panels_with_japanese_titles():
    import matplotlib.pyplot as plt

    fig = ac.plot_idea()
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    assert (
        len(titles) == 2
        and titles[0].startswith("勾配累積")
        and titles[1].startswith("活性化チェックポイント")
    )
