"""Lesson 04's accumulation apparatus: accumulation equals the big batch when weighted right (and Trainer's
does not for DistilBERT unless told); the recorder sets each loop's update beside the exact one; the peak
follows the micro-batch."""

import copy

import pytest
import torch

from course_lib.apparatus import accumulation as ac
from course_lib.distributed import disable_dropout, flat_params, max_abs_diff
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


def test_accumulate_returns_the_window_loss_and_refuses_what_it_cannot_weight(model, batch):
    work = copy.deepcopy(model)
    window_loss = ac.accumulate(work, ac.split_batch(batch, [2, 4, 6]), "examples")
    with torch.no_grad():
        assert window_loss == pytest.approx(model(**batch).loss.item(), rel=1e-5)  # the mean over all rows
    for weighting, parts, k in (("sum", [batch], None), ("mean", [], None), ("mean", [batch], 0)):
        with pytest.raises(ValueError, match="weighting"):
            ac.accumulate(copy.deepcopy(model), parts, weighting, k)


@pytest.mark.parametrize("sizes", [[6, 6], [3, 3, 3, 3]])
def test_equal_micro_batches_give_the_big_batch_gradient_either_way(model, batch, sizes):
    reference = ac.accumulated_gradients(model, [batch])
    for weighting in ("mean", "examples"):
        grads = ac.accumulated_gradients(model, ac.split_batch(batch, sizes), weighting)
        assert max_abs_diff(grads, reference) < TOL, weighting


def test_unequal_micro_batches_need_example_weights(model, batch):
    reference = ac.accumulated_gradients(model, [batch])
    parts = ac.split_batch(batch, [2, 10])
    assert max_abs_diff(ac.accumulated_gradients(model, parts, "examples"), reference) < TOL
    assert max_abs_diff(ac.accumulated_gradients(model, parts, "mean"), reference) > 100 * TOL


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
    assert max_abs_diff(params, expected) < TOL


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
    assert max_abs_diff(update, -0.5 * ac.accumulated_gradients(shifted, [batch])) < TOL
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
    # Trainer's default, the lesson's fix, and Trainer's documented switch (one process: no scaling by ranks)
    for switch in (None, ("model_accepts_loss_kwargs", False), ("loss_is_scaled_for_ga", False)):
        work = copy.deepcopy(model)
        sgd = torch.optim.SGD(work.parameters(), lr=1.0)
        recorder = ac.StepRecorder(sgd, work)
        trainer = Trainer(model=work, args=args, train_dataset=rows, optimizers=(sgd, None))
        trainer.remove_callback(PrinterCallback)
        assert trainer.model_accepts_loss_kwargs is True and trainer.loss_is_scaled_for_ga is None
        if switch is not None:
            setattr(trainer, *switch)
        trainer.train()
        (row,) = ac.compare_updates(recorder, model, [batch], TOL)
        ratios[switch and switch[0]] = (row["same"], round(row["ratio"], 3))
    assert ratios == {
        None: (False, 2.0),
        "model_accepts_loss_kwargs": (True, 1.0),
        "loss_is_scaled_for_ga": (True, 1.0),
    }


def test_accumulation_seconds_times_each_split_and_leaves_no_gradients(model, batch):
    work = copy.deepcopy(model)
    splits = {"one batch": [batch], "3 micro-batches": ac.split_batch(batch, [4, 4, 4])}
    seconds = ac.accumulation_seconds(work, splits, warmup=0, repeat=1)
    assert set(seconds) == set(splits) and all(t > 0 for t in seconds.values())
    assert all(p.grad is None for p in work.parameters())  # reset after timing
    with pytest.raises(ValueError, match="repeat"):
        ac.accumulation_seconds(work, splits, repeat=0)


def test_update_ratios_are_drawn_as_one_bar_per_loop_and_window():
    import matplotlib.pyplot as plt

    rows = [{"window": 1, "rows": 32, "ratio": 1.0}, {"window": 2, "rows": 8, "ratio": 0.25}]
    ax = ac.plot_update_ratios({"loop": rows, "Accelerate": [rows[0], {**rows[1], "ratio": 4.0}]})
    heights = sorted(round(p.get_height(), 2) for p in ax.patches)
    plt.close(ax.figure)
    assert heights == [0.25, 1.0, 1.0, 4.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["窓 1（32 行）", "窓 2（8 行）"]
