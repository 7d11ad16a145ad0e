"""Behaviours of the training loop that mutation testing found unguarded (docs/mutation.md).

Each test checks what the loop does for the learner on a tiny model whose steps take microseconds:
which rows evaluation scores and in which mode, the learning rate of every step of a run, and which
batches a resumed run trains on, from every kind of position in an epoch and an accumulation window.
"""

import warnings
from types import SimpleNamespace

# torch._dynamo imported at collection: a run's first step imports it (seconds), and mutmut's fork server
# collects once, so each mutant's run does not pay that again
import pytest
import torch
import torch._dynamo  # noqa: F401

from course_lib import training
from course_lib.training.clip import clip_gradients
from course_lib.training.metrics import evaluate


class Rows(torch.nn.Module):
    """``model(**batch)``: logits ``x @ w``; records each forward's mode, autocast state and row ids."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.seen: list[dict] = []

    def forward(self, input_ids, labels, row=None):
        logits = self.linear(input_ids)
        self.seen.append(
            {
                "training": self.training,
                "dtype": logits.dtype,
                "rows": None if row is None else row.tolist(),
            }
        )
        return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits.float(), labels))


def _batches(n: int, size: int = 2, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randn(size, 4, generator=g),
            "labels": torch.randint(0, 2, (size,), generator=g),
            "row": torch.arange(i * size, (i + 1) * size),
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------------------------------------
# Evaluation


@pytest.mark.parametrize("was_training", [True, False])
def test_evaluation_runs_in_eval_mode_and_gives_the_model_back_in_its_mode(was_training):
    model = Rows().train(was_training)
    evaluate(model, _batches(2))
    assert [s["training"] for s in model.seen] == [False, False]  # dropout off while scoring
    assert model.training is was_training


def test_evaluation_autocasts_at_the_precision_asked_for():
    model = Rows()
    evaluate(model, _batches(1), precision="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without native bf16 warns: not what this test checks
        evaluate(model, _batches(1), precision="bf16")
    assert [s["dtype"] for s in model.seen] == [torch.float32, torch.bfloat16]


class TwoRanks:
    """An Accelerator of rank 0 of 2 for ``evaluate``: ``gather_for_metrics`` appends rank 1's rows (the
    same rows with every label flipped and the losses those flipped labels give), as two processes'
    gather does; the prepared model autocasts itself, so evaluation must not."""

    device = torch.device("cpu")

    def __init__(self, model):
        self.model = model
        self.gathered = 0

    def gather_for_metrics(self, tensors):
        self.gathered += 1
        preds, labels, losses = tensors
        flipped = 1 - labels
        logits = self.model.last_logits.float()
        other = torch.nn.functional.cross_entropy(logits, flipped, reduction="none")
        return torch.cat([preds, preds]), torch.cat([labels, flipped]), torch.cat([losses, other])


class RowsKeepingLogits(Rows):
    def forward(self, input_ids, labels, row=None):
        out = super().forward(input_ids, labels, row)
        self.last_logits = out.logits.detach()
        return out


def test_evaluation_in_several_processes_scores_every_process_rows():
    """Rank 1's rows carry the opposite labels: accuracy over both ranks is exactly 0.5 and the loss the
    mean over all four rows' losses, which no score of rank 0's rows alone gives."""
    model = RowsKeepingLogits().train()
    batches = _batches(2, size=3)
    alone = evaluate(model, batches)
    acc = TwoRanks(model)
    both = evaluate(model, batches, precision="bf16", accelerator=acc)
    assert acc.gathered == 2  # every batch gathered
    assert both["accuracy"] == pytest.approx(0.5)
    logits = model.linear(torch.cat([b["input_ids"] for b in batches])).detach()
    labels = torch.cat([b["labels"] for b in batches])
    ce = torch.nn.functional.cross_entropy
    expected = torch.cat([ce(logits, labels, reduction="none"), ce(logits, 1 - labels, reduction="none")])
    assert both["loss"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert both["loss"] != pytest.approx(alone["loss"], rel=1e-3)
    # the accelerator's prepared model autocasts itself: evaluate asks for no autocast of its own
    assert model.seen[-1]["dtype"] == torch.float32 and not model.seen[-1]["training"]
    assert model.training


def test_f1_counts_false_positives_and_false_negatives_apart_from_true_negatives():
    # tp = 1, fp = 2, fn = 1, tn = 3: F1 = 2 / (2 + 2 + 1)
    preds = torch.tensor([1, 1, 1, 0, 0, 0, 0])
    labels = torch.tensor([1, 0, 0, 1, 0, 0, 0])
    m = training.accuracy_f1(preds, labels)
    assert m["f1"] == pytest.approx(2 / 5) and m["accuracy"] == pytest.approx(4 / 7)
    assert training.accuracy_f1(torch.tensor([0, 0]), torch.tensor([1, 0]))["f1"] == 0.0  # no tp: 0
    # nothing positive anywhere: no tp, fp or fn; F1 is 0, not 0 / 0
    assert training.accuracy_f1(torch.tensor([0, 0]), torch.tensor([0, 0])) == {"accuracy": 1.0, "f1": 0.0}
    assert (
        training.accuracy_f1(torch.tensor([[1], [0]]), torch.tensor([1, 0]))["f1"] == 1.0
    )  # shapes flattened


# ----------------------------------------------------------------------------------------------
# The learning-rate schedule over a whole run


class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate of every step it takes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used: list[float] = []

    def step(self, closure=None):
        self.used.append(self.param_groups[0]["lr"])
        return super().step(closure)


def _lrs_of_run(
    steps: int, warmup_ratio: float, lr: float = 0.1, start_step: int = 0, k: int = 1
) -> list[float]:
    """The learning rate each optimizer step of a run used, read in the optimizer before the step."""
    model = Rows()
    optimizer = RecordingSGD(model.parameters(), lr=lr)
    cfg = training.TrainConfig(
        epochs=1,
        lr=lr,
        warmup_ratio=warmup_ratio,
        grad_accum_steps=k,
        progress=False,
        device="cpu",
        max_grad_norm=None,
    )
    training.train(model, _batches(steps * k), cfg, optimizer=optimizer, start_step=start_step)
    return optimizer.used


def test_the_schedule_warms_up_linearly_then_decays_linearly_to_zero_over_the_whole_run():
    # 10 steps, warm-up 30 %: 3 warm-up steps at 1/3, 2/3, 3/3 of lr, then 7 steps from 7/7 down to 1/7
    expected = [0.1 * f for f in (1 / 3, 2 / 3, 1)] + [0.1 * (10 - s) / 7 for s in range(3, 10)]
    assert _lrs_of_run(10, 0.3) == pytest.approx(expected)
    # no warm-up: from lr down, the last step at lr / steps (zero would be a wasted step)
    assert _lrs_of_run(4, 0.0) == pytest.approx([0.1, 0.075, 0.05, 0.025])
    # accumulation: the schedule counts optimizer steps, not micro-batches
    assert _lrs_of_run(4, 0.0, k=3) == pytest.approx([0.1, 0.075, 0.05, 0.025])


@pytest.mark.parametrize("start_step", [1, 3, 5, 9])
def test_a_resumed_run_continues_the_schedule_where_it_stopped(start_step):
    assert _lrs_of_run(10, 0.3, start_step=start_step) == pytest.approx(_lrs_of_run(10, 0.3)[start_step:])


def test_a_one_step_warm_up_of_a_short_run_still_trains_at_full_rate():
    # 3 steps, warm-up 50 %: int(1.5) = 1 warm-up step at lr, then 2/2 and 1/2 of it
    assert _lrs_of_run(3, 0.5) == pytest.approx([0.1, 0.1, 0.05])


# ----------------------------------------------------------------------------------------------
# Resuming from every kind of position in an epoch and an accumulation window


def _rows_trained(batches: list[dict], k: int, epochs: int, start_step: int = 0, max_steps=None):
    model = Rows()
    cfg = training.TrainConfig(
        epochs=epochs,
        max_steps=max_steps,
        lr=1e-2,
        warmup_ratio=0.0,
        grad_accum_steps=k,
        progress=False,
        device="cpu",
        max_grad_norm=None,
    )
    history = training.train(model, batches, cfg, start_step=start_step)
    return [s["rows"] for s in model.seen], len(history.losses)


# 7 batches, k = 3: windows of 3, 3 and a short last one of 1, so 3 steps per epoch; 2 epochs = 6 steps
@pytest.mark.parametrize(
    "start_step",
    [
        0,  # the beginning
        1,  # after the first window, mid-epoch
        2,  # before the epoch's short last window
        3,  # at the second epoch's first batch
        4,  # mid-epoch of the second epoch
        5,  # before the run's last (short) window
    ],
)
def test_a_resumed_run_trains_on_exactly_the_batches_the_uninterrupted_run_had_left(start_step):
    batches = _batches(7)
    full, full_steps = _rows_trained(batches, k=3, epochs=2)
    windows = [3, 3, 1] * 2  # micro-batches per step of the uninterrupted run
    assert full_steps == 6 and len(full) == 14
    resumed, steps = _rows_trained(batches, k=3, epochs=2, start_step=start_step)
    assert resumed == full[sum(windows[:start_step]) :]
    assert steps == 6 - start_step


def test_a_resumed_run_with_max_steps_ends_on_the_same_step():
    batches = _batches(7)
    full, _ = _rows_trained(batches, k=2, epochs=5, max_steps=6)  # 4 steps per epoch (2, 2, 2, 1)
    resumed, steps = _rows_trained(batches, k=2, epochs=5, start_step=4, max_steps=6)
    assert steps == 2 and resumed == full[7:]
    assert len(full) == 7 + 4  # epoch 1 whole, then two windows of 2


# ----------------------------------------------------------------------------------------------
# The optimizer


class NamedNorms(torch.nn.Module):
    """2-D parameters under both spellings of a layer norm's name (a norm with a scale per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(4, 4)
        self.LayerNorm = torch.nn.Module()
        self.LayerNorm.weight = torch.nn.Parameter(torch.ones(3, 4))
        self.final_layer_norm = torch.nn.Module()
        self.final_layer_norm.weight = torch.nn.Parameter(torch.ones(3, 4))


def test_layer_norm_parameters_get_no_weight_decay_by_name_whatever_their_shape():
    model = NamedNorms()
    decay, no_decay = training.make_optimizer(model, lr=1e-3, weight_decay=0.1).param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert {id(p) for p in decay["params"]} == {id(model.dense.weight)}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {
        "dense.bias",
        "LayerNorm.weight",
        "final_layer_norm.weight",
    }


def test_an_unknown_optimizer_name_is_refused_with_the_known_ones():
    with pytest.raises(
        ValueError, match=r"^Unknown optimizer 'sgd': use one of adamw, adafactor, adamw8bit\.$"
    ):
        training.make_optimizer(Rows(), lr=1e-3, weight_decay=0.0, name="sgd")


@pytest.mark.parametrize("helper", [True, False])
def test_fused_adamw_is_used_on_the_cpu_and_never_for_a_device_without_the_kernel(monkeypatch, helper):
    """With torch's private helper, and with the fallback list when a torch release drops it."""
    from torch.utils import _foreach_utils

    from course_lib.training.optim import fused_adamw_supported

    if not helper:
        monkeypatch.delattr(_foreach_utils, "_get_fused_kernels_supported_devices")
    cpu = torch.nn.Parameter(torch.zeros(2))
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert fused_adamw_supported([cpu]) and not fused_adamw_supported([])
    assert not fused_adamw_supported([cpu, meta])  # one parameter on a device without the kernel: no
    assert not fused_adamw_supported([meta])
    integer = torch.zeros(2, dtype=torch.int64)
    assert not fused_adamw_supported([integer])


def test_importing_bitsandbytes_quiets_only_its_cpu_kernel_logger():
    import logging

    from course_lib.training.optim import _BNB_CPU_LOGGER, import_bitsandbytes

    root = logging.getLogger()
    before = root.level
    import_bitsandbytes()
    assert logging.getLogger(_BNB_CPU_LOGGER).level == logging.ERROR
    assert root.level == before  # every other message still shows


@pytest.mark.parametrize("name", ["adamw", "adafactor", "adamw8bit"])
def test_every_optimizer_trains_at_the_learning_rate_asked_for(name):
    optimizer = training.make_optimizer(Rows(), lr=0.0123, weight_decay=0.0, name=name)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0123, 0.0123]


def test_a_missing_bitsandbytes_says_how_to_install_it(monkeypatch):
    from course_lib.training import optim

    def missing():
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(optim, "import_bitsandbytes", missing)
    message = (
        "optimizer 'adamw8bit' needs bitsandbytes: pip install 'bitsandbytes==0.50.2' "
        "(the course's pyproject.toml installs it)."
    )
    with pytest.raises(ImportError) as raised:
        training.make_optimizer(Rows(), lr=1e-3, weight_decay=0.0, name="adamw8bit")
    assert str(raised.value) == message


def test_without_torch_s_helper_fused_adamw_is_known_on_cpu_and_cuda_only(monkeypatch):
    from torch.utils import _foreach_utils

    from course_lib.training.optim import fused_adamw_supported

    monkeypatch.delattr(_foreach_utils, "_get_fused_kernels_supported_devices")

    def on(device: str):  # a parameter's device without allocating there (no GPU needed)
        return SimpleNamespace(is_floating_point=lambda: True, device=torch.device(device))

    assert fused_adamw_supported([on("cpu"), on("cuda")])
    assert not fused_adamw_supported([on("mps")])


def test_a_new_schedule_starts_at_the_first_step_s_rate():
    optimizer = torch.optim.SGD(Rows().parameters(), lr=0.3)
    training.make_scheduler(optimizer, total_steps=10, warmup_ratio=0.3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # 1/3 of lr: warm-up step 1 of 3


def test_the_history_leaves_the_first_step_out_of_its_medians_by_default():
    """The first optimizer step carries the warm-up (allocation, kernel choice): the medians leave it out
    unless told otherwise, and tokens per second is tokens over seconds, step by step."""
    history = training.History(config={})
    history.step_times = [10.0, 1.0, 2.0, 9.0]  # the first step is the slow warm-up
    history.step_tokens = [1000, 10, 40, 90]  # per step: 100, 10, 20, 10 tokens per second
    assert history.median_step_time() == 2.0  # median of 1, 2, 9
    assert history.median_step_time(skip=0) == 5.5
    assert history.tokens_per_s() == 10.0  # median of 10, 20, 10
    assert history.tokens_per_s(skip=0) == 15.0


def test_clipping_reports_the_norm_over_every_ranks_shards_under_fsdp(monkeypatch):
    """Under FSDP, clip_grad_norm_ returns the norm as a DTensor whose local value is this rank's part;
    the reported norm is the full one (``full_tensor``), as every rank's log must agree. A one-process
    group cannot tell the two apart, so a stand-in norm plays a rank's sharded one."""

    class ShardedNorm:
        def full_tensor(self):
            return torch.tensor(5.0)  # the norm over all ranks' shards

        def __float__(self):
            return 1.0  # this rank's part only

    unscaled = []
    backend = SimpleNamespace(unscale=unscaled.append)
    model = torch.nn.Linear(2, 1)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: ShardedNorm())
    assert clip_gradients(backend, model, "the optimizer", 1.0) == 5.0
    assert unscaled == ["the optimizer"]  # unscaled before clipping
