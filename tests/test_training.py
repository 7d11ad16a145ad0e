import math
import warnings

import pytest
import torch

from course_lib import data, models, training
from course_lib.instruments import memory


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("embedded")


@pytest.fixture(scope="module")
def tokenized(tok):
    return data.tokenize_dataset(data.load_mrpc("embedded"), tok)


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_training_lowers_the_loss_and_records_history(tokenized, tok, precision):
    """On 32 rows for 10 epochs the loop must fit the data: the loss falls and history is complete."""
    train_dl, val_dl = data.make_dataloaders(
        tokenized, tok, batch_size=8, precision=precision, train_rows=32, eval_rows=32
    )
    model = models.load_model("embedded")
    cfg = training.TrainConfig(epochs=10, lr=1e-3, warmup_ratio=0.05, precision=precision, progress=False)
    history = training.train(model, train_dl, cfg, eval_dataloader=val_dl)
    assert len(history.losses) == 40 and len(history.evals) == 10
    assert all(math.isfinite(x) for x in history.losses)
    assert sum(history.losses[-4:]) < 0.7 * sum(history.losses[:4])
    assert history.tokens_per_s() > 0 and history.median_step_time() > 0
    assert history.config["precision"] == precision


def test_fp16_uses_a_grad_scaler_and_warns_on_cpu(tokenized, tok):
    train_dl, _ = data.make_dataloaders(tokenized, tok, batch_size=8, precision="fp16", train_rows=24)
    model = models.load_model("embedded")
    with pytest.warns(UserWarning, match="fp16 on a CPU"):
        history = training.train(
            model, train_dl, training.TrainConfig(precision="fp16", device="cpu", progress=False)
        )
    assert len(history.scaler_scales) == 3  # the scaler was live and updated every step
    assert all(math.isfinite(x) for x in history.losses)


def test_gradient_accumulation_equals_one_big_batch(tokenized, tok):
    """2 micro-batches of 4 then one step == one batch of 8 then one step (no dropout, SGD)."""
    rows = tokenized["train"].select(range(8))
    params = []
    for batch_size, accum in [(8, 1), (4, 2)]:
        torch.manual_seed(0)
        model = _no_dropout(models.load_model("embedded"))
        dl = data.make_dataloader(rows, tok, batch_size=batch_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = training.TrainConfig(
            max_steps=1, grad_accum_steps=accum, max_grad_norm=None, warmup_ratio=0, progress=False
        )
        training.train(model, dl, cfg, optimizer=opt)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # Padding differs between one batch of 8 and two of 4; masked positions do not change the result.
    torch.testing.assert_close(params[0], params[1], rtol=1e-4, atol=1e-5)


def test_gradient_clipping_bounds_the_update(tokenized, tok):
    rows = tokenized["train"].select(range(8))
    model = _no_dropout(models.load_model("embedded"))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = training.TrainConfig(max_steps=1, max_grad_norm=1e-3, warmup_ratio=0, progress=False)
    training.train(model, data.make_dataloader(rows, tok, batch_size=8), cfg, optimizer=opt)
    delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert delta.item() == pytest.approx(1e-3, rel=1e-2)  # lr 1 x clipped norm


def test_training_through_an_accelerator(tokenized, tok):
    train_dl, val_dl = data.make_dataloaders(
        tokenized, tok, batch_size=16, precision="bf16", train_rows=64, eval_rows=32
    )
    accelerator = training.fresh_accelerator(mixed_precision="bf16", cpu=True)
    assert training.amp_is_active(accelerator)
    history = training.train(
        models.load_model("embedded"),
        train_dl,
        training.TrainConfig(progress=False),
        eval_dataloader=val_dl,
        accelerator=accelerator,
    )
    assert history.config["precision"] == "bf16" and len(history.losses) == 4
    final = history.evals[-1]
    assert final["step"] == 4 and final["accuracy"] * 32 == pytest.approx(round(final["accuracy"] * 32))
    assert math.isfinite(final["loss"]) and history.losses[-1] != history.losses[0]


def test_fresh_accelerator_allows_a_second_precision_and_flags_fp16_on_cpu():
    training.fresh_accelerator(mixed_precision="bf16", cpu=True)
    with pytest.warns(UserWarning, match="does nothing"):
        acc = training.fresh_accelerator(mixed_precision="fp16", cpu=True)
    assert not training.amp_is_active(acc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not training.amp_is_active(training.fresh_accelerator(cpu=True))


def test_accuracy_f1_against_hand_computed_values():
    preds, labels = torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1])
    m = training.accuracy_f1(preds, labels)
    assert m["accuracy"] == pytest.approx(0.6)
    assert m["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    with pytest.raises(ValueError, match="empty"):
        training.accuracy_f1(torch.tensor([]), torch.tensor([]))
    with pytest.raises(ValueError, match="shape"):
        training.accuracy_f1(torch.tensor([1, 0]), torch.tensor([1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"lr": 0}, "lr must be positive"),
        ({"epochs": 0}, "nothing to train"),
        ({"optimizer": "sgd"}, "optimizer must be one of adamw, adafactor, adamw8bit"),
        ({"comm_hook": "int8"}, "comm_hook must be one of none, fp16, bf16"),
        ({"local_sgd_steps": 0}, "local_sgd_steps must be >= 1"),
    ],
)
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training.TrainConfig(**kwargs)


def test_empty_dataloader_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        training.train(torch.nn.Linear(1, 1), [], training.TrainConfig(progress=False))


def test_make_optimizer_uses_the_fused_kernel_and_updates_like_plain_adamw():
    def step(fused):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        optimizer = training.make_optimizer(model, lr=1e-2, weight_decay=0.1, fused=fused)
        for _ in range(3):
            model(torch.ones(4, 8)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    fused_model, fused_opt = step(None)
    plain_model, plain_opt = step(False)
    assert fused_opt.defaults["fused"] is True  # the CPU has a fused AdamW kernel in torch 2.13
    assert not plain_opt.defaults["fused"]
    assert [g["weight_decay"] for g in fused_opt.param_groups] == [0.1, 0.0]
    assert len(fused_opt.param_groups[1]["params"]) == 4  # biases and LayerNorm weights: no decay
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not training.fused_adamw_supported([])


def _tiny_run(tokenized, tok, **config):
    """4 optimizer steps on 16 rows, dropout off: the losses and the model."""
    train_dl, _ = data.make_dataloaders(tokenized, tok, batch_size=4, train_rows=16)
    torch.manual_seed(0)
    model = _no_dropout(models.load_model("embedded"))
    cfg = training.TrainConfig(lr=1e-3, progress=False, max_grad_norm=None, **config)
    return training.train(model, train_dl, cfg).losses, model


def test_gradient_checkpointing_gives_the_same_training_and_saves_activations(tokenized, tok):
    """Checkpointing recomputes exactly what it dropped: the same losses, fewer bytes saved for backward."""
    plain, _ = _tiny_run(tokenized, tok)
    checkpointed, model = _tiny_run(tokenized, tok, gradient_checkpointing=True)
    assert model.is_activation_checkpointing
    torch.testing.assert_close(torch.tensor(checkpointed), torch.tensor(plain), rtol=1e-5, atol=1e-6)

    batch = next(iter(data.make_dataloaders(tokenized, tok, batch_size=4, train_rows=4)[0]))
    saved = {}
    for on in (False, True):
        training.enable_checkpointing(model, on)
        saved[on] = memory.saved_tensor_bytes(lambda: model(**batch).loss.backward())
    assert 0 < saved[True] < 0.5 * saved[False], saved
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        training.enable_checkpointing(torch.nn.Linear(2, 2))
    assert training.enable_checkpointing(torch.nn.Linear(2, 2), False) is not None  # off: nothing to do


@pytest.mark.parametrize("name", ["adafactor", "adamw8bit"])
def test_other_optimizers_train_and_keep_less_state_than_adamw(tokenized, tok, name):
    losses, model = _tiny_run(tokenized, tok, optimizer=name)
    assert all(math.isfinite(x) for x in losses) and len(losses) == 4
    assert losses[-1] < losses[0]

    layer = torch.nn.Linear(256, 256)  # 65,792 parameters: 8-bit state applies (>= 4,096 elements)
    n = sum(p.numel() for p in layer.parameters())
    state = {}
    for optimizer_name in ("adamw", name):
        optimizer = training.make_optimizer(layer, lr=1e-3, weight_decay=0.0, name=optimizer_name)
        assert memory.optimizer_state_bytes(optimizer) == 0  # created lazily
        layer(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        state[optimizer_name] = memory.optimizer_state_bytes(optimizer) / n
    assert state["adamw"] == 8.0  # two fp32 moments per parameter
    assert state[name] < 0.3 * state["adamw"], state
    assert training.TRAINER_OPTIM[name] in {"adafactor", "adamw_bnb_8bit"}


def test_local_sgd_and_comm_hooks_do_nothing_in_one_process(tokenized, tok):
    """With one process there is nothing to average or to send: the run is the plain one."""
    plain, _ = _tiny_run(tokenized, tok)
    assert _tiny_run(tokenized, tok, local_sgd_steps=2)[0] == plain
    assert _tiny_run(tokenized, tok, comm_hook="fp16")[0] == plain
    accelerated_plain = _accelerated(tokenized, tok)
    assert _accelerated(tokenized, tok, local_sgd_steps=2) == accelerated_plain  # one process: no-op
    assert _accelerated(tokenized, tok, comm_hook="fp16") == accelerated_plain  # (the two exclude each other)


def _accelerated(tokenized, tok, **config):
    train_dl, _ = data.make_dataloaders(tokenized, tok, batch_size=4, train_rows=16)
    torch.manual_seed(0)
    model = _no_dropout(models.load_model("embedded"))
    cfg = training.TrainConfig(lr=1e-3, progress=False, max_grad_norm=None, **config)
    accelerator = training.fresh_accelerator(cpu=True)
    return training.train(model, train_dl, cfg, accelerator=accelerator).losses


@pytest.mark.parametrize("name", ["adamw", "adafactor", "adamw8bit"])
def test_optimizer_state_survives_a_checkpoint_exactly(tmp_path, name):
    """save_optimizer / load_optimizer keep every optimizer's state, bitsandbytes' nested one included:
    the next step after loading equals the next step of the optimizer that never stopped."""
    from course_lib import checkpoints

    torch.manual_seed(0)
    x = torch.randn(2, 256)
    # Two big matrices: 8-bit AdamW shares its quantisation maps between them (saved as copies).
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    running, saved = (training.make_optimizer(la, 1e-3, 0.01, name=name) for la in layers)
    for layer, optimizer in zip(layers, (running, saved)):
        layer(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoints.save_optimizer(saved, tmp_path / "optimizer.safetensors")
    loaded = training.make_optimizer(layers[1], 1e-3, 0.01, name=name)
    checkpoints.load_optimizer(loaded, tmp_path / "optimizer.safetensors")
    for layer, optimizer in zip(layers, (running, loaded)):
        layer(x).sum().backward()
        optimizer.step()
    for a, b in zip(layers[0].parameters(), layers[1].parameters()):
        assert torch.equal(a, b)


def test_micro_batches_mark_updates_and_the_short_last_window():
    """5 micro-batches with k=4: one full window and a window of 1, whose loss is divided by 1, not 4."""
    from course_lib.training.accum import micro_batches

    marks = [(update, window) for _, update, window in micro_batches(range(5), 4)]
    assert marks == [(False, 4), (False, 4), (False, 4), (True, 4), (True, 1)]
    assert [(u, w) for _, u, w in micro_batches(range(5), 4, start=4)] == [(True, 1)]  # resumed there
    assert [(u, w) for _, u, w in micro_batches(range(6), 3)] == [(False, 3), (False, 3), (True, 3)] * 2


class _TinyClassifier(torch.nn.Module):
    """The loop's model interface (``model(**batch).loss``) on 4 numbers per row: steps take microseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.linear(input_ids), labels))


def test_progress_bar_redraws_a_bounded_number_of_times_however_slow_the_steps(monkeypatch):
    """Every step slower than PROGRESS_INTERVAL (faked: interval 0) still redraws about PROGRESS_REDRAWS
    times per run, not once a step: a long cell on a loaded machine stays within nbval's message budget."""
    import io

    from tqdm import tqdm as text_tqdm

    from course_lib.training import loop

    bars = []

    class CountingBar(text_tqdm):
        def __init__(self, *args, **kwargs):
            self.redraws = 0
            super().__init__(*args, file=io.StringIO(), **kwargs)
            bars.append(self)

        def refresh(self, *args, **kwargs):
            self.redraws += 1
            return super().refresh(*args, **kwargs)

    monkeypatch.setattr(loop, "tqdm", CountingBar)
    monkeypatch.setattr(loop, "PROGRESS_INTERVAL", 0.0)  # as if every step took longer than the interval
    rows = [{"input_ids": torch.randn(1, 4), "labels": torch.tensor([i % 2])} for i in range(100)]
    cfg = training.TrainConfig(epochs=1, lr=1e-2, warmup_ratio=0, progress=True, device="cpu")
    history = training.train(_TinyClassifier(), rows, cfg, optimizer=None)
    assert len(history.losses) == 100 and len(bars) == 1 and bars[0].n == 100
    assert 2 <= bars[0].redraws <= loop.PROGRESS_REDRAWS + 2, bars[0].redraws  # + the first and the last


def test_evaluation_loss_is_the_mean_over_rows_not_over_batches():
    """A short last batch weighs by its rows: 3 rows + 1 row, each row's loss known in advance."""
    from types import SimpleNamespace

    from course_lib.training.metrics import evaluate

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, logits, labels):
            loss = torch.nn.functional.cross_entropy(logits, labels)  # the batch mean, as a model returns
            return SimpleNamespace(logits=logits + self.w, loss=loss)

    rows = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 3.0]])
    labels = torch.tensor([0, 1, 1, 0])
    batches = [{"logits": rows[:3], "labels": labels[:3]}, {"logits": rows[3:], "labels": labels[3:]}]
    per_row = torch.nn.functional.cross_entropy(rows, labels, reduction="none")
    metrics = evaluate(Fixed(), batches)
    assert metrics["loss"] == pytest.approx(per_row.mean().item(), rel=1e-6)
    batch_means = (per_row[:3].mean() + per_row[3:].mean()).item() / 2
    assert abs(metrics["loss"] - batch_means) > 0.1  # the two means differ here, so the check can fail
    assert metrics["accuracy"] == 0.5


def test_the_recorded_loss_of_an_accumulated_step_is_the_mean_over_its_window(tokenized, tok):
    """k = 2: history's first loss is the mean of the two micro-batches' losses before the update."""
    rows = tokenized["train"].select(range(8))
    loader = data.make_dataloader(rows, tok, batch_size=4)
    torch.manual_seed(0)
    model = _no_dropout(models.load_model("embedded"))
    model.eval()
    with torch.no_grad():
        losses = [model(**batch).loss.item() for batch in loader]
    assert abs(losses[0] - losses[1]) > 1e-3  # the last micro-batch's loss differs from the mean
    cfg = training.TrainConfig(
        grad_accum_steps=2, max_steps=1, lr=1e-3, progress=False, eval_every_epoch=False
    )
    history = training.train(model, loader, cfg)
    assert history.losses == [pytest.approx(sum(losses) / 2, rel=1e-5)]
