"""Lesson 04's demonstrations: accumulation equals the big batch when weighted right; checkpointing
recomputes each layer once, keeps the gradients and saves fewer bytes; sqrt(n) on a synthetic stack."""

import copy

import pytest
import torch

from course_lib.demos import accumulation_checkpointing as ac
from course_lib.distributed import disable_dropout, flat_grads
from course_lib.instruments.memory import saved_tensor_bytes
from course_lib.models import load_model

TOL = 1e-5  # float32 rounding of a reordered sum is ~1e-7 here


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return disable_dropout(load_model()).train()


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 1000, (12, 16), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::3, 10:] = 0  # some padding, as real batches have
    labels = torch.randint(0, 2, (12,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def test_split_batch_cuts_consecutive_rows_and_checks_sizes(batch):
    parts = ac.split_batch(batch, [2, 4, 6])
    assert [ac.rows(p) for p in parts] == [2, 4, 6]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    with pytest.raises(ValueError, match="add up"):
        ac.split_batch(batch, [4, 4])
    with pytest.raises(ValueError, match="disagree"):
        ac.split_batch({"a": torch.zeros(3), "labels": torch.zeros(4)}, [3])


def test_weights_mean_divides_by_k_and_examples_by_the_window_size():
    assert ac.micro_batch_weights([8, 8, 8, 8], "mean") == [0.25] * 4
    assert ac.micro_batch_weights([8], "mean", k=4) == [0.25]  # the loop's short last window
    assert ac.micro_batch_weights([2, 6], "examples") == [0.25, 0.75]
    assert ac.micro_batch_weights([8], "examples") == [1.0]
    with pytest.raises(ValueError, match="weighting"):
        ac.micro_batch_weights([8], "sum")
    with pytest.raises(ValueError, match="positive"):
        ac.micro_batch_weights([], "mean")


@pytest.mark.parametrize("sizes", [[6, 6], [3, 3, 3, 3]])
def test_equal_micro_batches_give_the_big_batch_gradient_either_way(model, batch, sizes):
    reference = ac.accumulated_gradients(model, [batch])
    for weighting in ("mean", "examples"):
        grads = ac.accumulated_gradients(model, ac.split_batch(batch, sizes), weighting)
        assert ac.max_abs_diff(grads, reference) < TOL, weighting


def test_unequal_micro_batches_need_example_weights(model, batch):
    reference = ac.accumulated_gradients(model, [batch])
    parts = ac.split_batch(batch, [2, 10])
    assert ac.max_abs_diff(ac.accumulated_gradients(model, parts, "examples"), reference) < TOL
    assert ac.max_abs_diff(ac.accumulated_gradients(model, parts, "mean"), reference) > 100 * TOL


def test_short_last_window_divided_by_k_gets_a_quarter_of_the_gradient(model, batch):
    window = ac.split_batch(batch, [3, 9])[:1]  # one micro-batch left in a window of k=4
    loop = ac.accumulated_gradients(model, window, "mean", k=4)
    exact = ac.accumulated_gradients(model, window, "examples")
    assert torch.equal(loop, exact * 0.25)  # scaling by a power of two is exact


def test_sgd_update_leaves_the_model_and_steps_by_lr_times_gradient(model, batch):
    before = [p.detach().clone() for p in model.parameters()]
    params = ac.sgd_update(model, ac.split_batch(batch, [4, 8]), lr=0.5)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    expected = torch.cat([p.flatten() for p in before]) - 0.5 * ac.accumulated_gradients(model, [batch])
    assert ac.max_abs_diff(params, expected) < TOL


def test_accumulation_peak_follows_the_micro_batch(model):
    work = copy.deepcopy(model)
    ids = torch.randint(5, 1000, (32, 32), generator=torch.Generator().manual_seed(1))
    big = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.zeros(32, dtype=torch.long),
    }
    ac.step_peak_mb(work, [big])  # warm-up: one-off allocations stay out of the comparison
    whole = ac.step_peak_mb(work, [big])
    micro = ac.step_peak_mb(work, ac.split_batch(big, [8, 8, 8, 8]))
    assert 0 < micro < 0.6 * whole, (micro, whole)
    assert all(p.grad is None for p in work.parameters())


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
    assert ac.max_abs_diff(flat_grads(checkpointed), flat_grads(plain)) < TOL
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


def test_errors_say_what_to_pass():
    stack = ac.linear_gelu_stack(3, width=4)
    with pytest.raises(ValueError, match="segments"):
        ac.stack_saved_bytes(stack, torch.randn(2, 4), segments=4)
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        ac.checkpointed_layers(stack)
    with pytest.raises(ValueError, match="plain_runs"):
        ac.compute_ratio(2, 1)
    with pytest.raises(ValueError, match="Shapes"):
        ac.max_abs_diff(torch.zeros(2), torch.zeros(3))
    assert torch.equal(
        ac.linear_gelu_stack(2, 4, seed=1)[0][0].weight, ac.linear_gelu_stack(2, 4, seed=1)[0][0].weight
    )
