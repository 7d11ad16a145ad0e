"""Lesson 04's demonstrations: accumulation equals the big batch when weighted right (and Trainer's does
not for DistilBERT unless told); checkpointing recomputes each layer once, keeps the gradients and saves
fewer bytes; forward and backward timed apart; sqrt(n) on a synthetic stack; model states read from tensors."""

import copy

import pytest
import torch

from course_lib.apparatus import accumulation_checkpointing as ac
from course_lib.distributed import disable_dropout, flat_grads, flat_params
from course_lib.instruments.memory import model_state_bytes, saved_tensor_bytes
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


def _manual_accumulation(model, parts, divide_by_k: bool, lr: float = 0.5):
    """One SGD update over ``parts``, each loss divided by k (right) or not at all (Trainer's slip)."""
    work = copy.deepcopy(model)
    optimizer = torch.optim.SGD(work.parameters(), lr=lr)
    recorder = ac.StepRecorder(optimizer, work)
    for part in parts:
        loss = work(**part).loss
        (loss / len(parts) if divide_by_k else loss).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.step()  # no gradients: SGD skips every parameter, the recorder still sees a step
    recorder.remove()
    optimizer.step()  # after remove(): not recorded
    return recorder


def test_step_recorder_compares_each_update_with_the_exact_one(model, batch):
    parts = ac.split_batch(batch, [3, 3, 3, 3])
    right = _manual_accumulation(model, parts, divide_by_k=True)
    assert len(right.before) == len(right.after) == len(right.lrs) == 2 and right.lrs == [0.5, 0.5]
    assert torch.count_nonzero(right.updates()[1]) == 0
    first = ac.compare_updates(right, model, [batch, batch], TOL)[0]
    assert first["same"] and first["ratio"] == pytest.approx(1.0, abs=1e-4) and first["rows"] == 12
    summed = ac.compare_updates(
        _manual_accumulation(model, parts, divide_by_k=False), model, [batch, batch], TOL
    )
    assert not summed[0]["same"] and summed[0]["ratio"] == pytest.approx(4.0, abs=1e-4)
    with pytest.raises(ValueError, match="one batch per step"):
        ac.compare_updates(right, model, [batch], TOL)


def test_exact_update_starts_from_the_given_parameters(model, batch):
    params = flat_params(model) + 0.01
    update = ac.exact_update(model, params, batch, lr=0.5)
    shifted = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(params, shifted.parameters())
    assert ac.max_abs_diff(update, -0.5 * ac.accumulated_gradients(shifted, [batch])) < TOL
    assert torch.equal(flat_params(model) + 0.01, params)  # the model and params are left as they were


@pytest.mark.slow  # a Trainer (and its Accelerator) twice: a few seconds
def test_trainer_accumulation_of_distilbert_is_k_times_the_big_batch_unless_told(model, batch, tmp_path):
    """transformers 5.24 (huggingface/transformers#47688): a forward with **kwargs makes Trainer skip its
    division by the accumulation steps. If this fails, transformers changed: update lesson 04 section 4."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    rows = Dataset.from_dict({key: value.tolist() for key, value in batch.items()})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=6,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    ratios = {}
    for fix in (None, False):
        work = copy.deepcopy(model)
        sgd = torch.optim.SGD(work.parameters(), lr=1.0)
        recorder = ac.StepRecorder(sgd, work)
        trainer = Trainer(model=work, args=args, train_dataset=rows, optimizers=(sgd, None))
        trainer.remove_callback(PrinterCallback)
        assert trainer.model_accepts_loss_kwargs is True
        if fix is not None:
            trainer.model_accepts_loss_kwargs = fix
        trainer.train()
        (row,) = ac.compare_updates(recorder, model, [batch], TOL)
        ratios[fix] = (row["same"], round(row["ratio"], 3))
    assert ratios == {None: (False, 2.0), False: (True, 1.0)}


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


def test_accumulation_seconds_times_each_split_and_leaves_no_gradients(model, batch):
    work = copy.deepcopy(model)
    splits = {"one batch": [batch], "3 micro-batches": ac.split_batch(batch, [4, 4, 4])}
    seconds = ac.accumulation_seconds(work, splits, warmup=0, repeat=1)
    assert set(seconds) == set(splits) and all(t > 0 for t in seconds.values())
    assert all(p.grad is None for p in work.parameters())  # reset after timing
    with pytest.raises(ValueError, match="repeat"):
        ac.accumulation_seconds(work, splits, repeat=0)


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
