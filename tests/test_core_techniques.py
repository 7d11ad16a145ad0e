"""Behaviours of the loop's technique files that mutation testing found unguarded (docs/mutation.md).

One section per file of ``course_lib/training``: the kernels switches (``kernels.py``), the plain-PyTorch
backend's placement, autocast and loss scaling (``amp.py``), activation checkpointing
(``activation_checkpointing.py``), the slides' reference loops (``slides.py``) and the local-SGD switch
(``local_sgd.py``). Each test checks what the code does for a learner's run, on models whose steps take
milliseconds.
"""

import warnings
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from course_lib.training import History
from course_lib.training.activation_checkpointing import enable_checkpointing
from course_lib.training.amp import TorchAmp
from course_lib.training.kernels import compiled, set_attention
from course_lib.training.local_sgd import local_sgd
from course_lib.training.slides import train_accelerate, train_pytorch


def _distilbert(seed: int = 0) -> DistilBertForSequenceClassification:
    """A two-layer DistilBERT of width 8 (random weights): the course's model family, in milliseconds."""
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=30, dim=8, hidden_dim=16, n_layers=2, n_heads=2, max_position_embeddings=16
    )
    return DistilBertForSequenceClassification(config)


def _tokens(seed: int = 0, rows: int = 4, length: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 30, (rows, length), generator=g),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (rows,), generator=g),
    }


# ----------------------------------------------------------------------------------------------
# kernels.py: the attention implementation and torch.compile


def test_set_attention_switches_the_implementation_and_keeps_the_function():
    model = _distilbert().eval()
    batch = _tokens()
    outputs = {}
    for implementation in ("eager", "sdpa"):
        assert set_attention(model, implementation) is model
        assert model.config._attn_implementation == implementation
        with torch.no_grad():
            outputs[implementation] = model(**batch).logits
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], rtol=1e-4, atol=1e-5)


def test_set_attention_none_leaves_the_model_as_loaded():
    model = _distilbert()
    model.set_attn_implementation("eager")
    assert set_attention(model, None) is model
    assert model.config._attn_implementation == "eager"


def test_set_attention_refuses_an_unknown_implementation_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"one of eager, sdpa, got 'flash'"):
        set_attention(_distilbert(), "flash")


def test_sdpa_is_refused_for_a_model_without_it_and_eager_still_works():
    model = _distilbert()
    model.set_attn_implementation("eager")
    model._supports_sdpa = False  # as an architecture without an SDPA kernel in transformers
    with pytest.raises(ValueError, match="DistilBertForSequenceClassification has no SDPA attention"):
        set_attention(model, "sdpa")
    assert model.config._attn_implementation == "eager"
    assert set_attention(model, "eager").config._attn_implementation == "eager"


class AnyModel(torch.nn.Module):
    """A model that is not from transformers: no ``_supports_sdpa`` flag; records the switch asked for."""

    def set_attn_implementation(self, implementation):
        self.implementation = implementation


def test_sdpa_is_refused_for_a_model_that_does_not_say_it_has_it():
    with pytest.raises(ValueError, match="AnyModel has no SDPA attention"):
        set_attention(AnyModel(), "sdpa")
    assert set_attention(AnyModel(), "eager").implementation == "eager"


def _recorded_compile(monkeypatch) -> list[dict]:
    calls: list[dict] = []

    def fake_compile(model, **kwargs):
        calls.append({"model": model, **kwargs})
        return ("compiled", model)

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_compiled_is_the_model_itself_when_off(monkeypatch):
    calls = _recorded_compile(monkeypatch)
    model = _distilbert()
    assert compiled(model, False) is model
    assert calls == []


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_compiled_compiles_the_model_with_the_dynamic_setting_asked_for(monkeypatch, dynamic):
    calls = _recorded_compile(monkeypatch)
    model = _distilbert()
    assert compiled(model, True, dynamic) == ("compiled", model)
    assert calls == [{"model": model, "dynamic": dynamic}]


def test_compiling_a_classifier_fixes_its_problem_type_before_the_first_forward(monkeypatch):
    """transformers sets config.problem_type at the first forward; set during compilation, that change
    would force a second compilation. A regression head (one label) is left for transformers to decide."""
    _recorded_compile(monkeypatch)
    classifier = _distilbert()
    assert classifier.config.problem_type is None
    compiled(classifier, True)
    assert classifier.config.problem_type == "single_label_classification"
    regression = DistilBertForSequenceClassification(
        DistilBertConfig(**{**_distilbert().config.to_dict(), "num_labels": 1})
    )
    compiled(regression, True)
    assert regression.config.problem_type is None
    multi = _distilbert()
    multi.config.problem_type = "multi_label_classification"
    compiled(multi, True)
    assert multi.config.problem_type == "multi_label_classification"
    plain = torch.nn.Linear(2, 2)  # no config at all
    assert compiled(plain, True) == ("compiled", plain)
    # a config without one of the two fields (not a transformers config) is left as it is
    unlabelled = torch.nn.Linear(2, 2)
    unlabelled.config = SimpleNamespace(problem_type=None)
    compiled(unlabelled, True)
    assert unlabelled.config.problem_type is None
    untyped = torch.nn.Linear(2, 2)
    untyped.config = SimpleNamespace(num_labels=2)
    compiled(untyped, True)
    assert not hasattr(untyped.config, "problem_type")


# ----------------------------------------------------------------------------------------------
# amp.py: the plain-PyTorch backend


def test_torch_amp_puts_the_model_and_each_batch_on_its_device():
    amp = TorchAmp(torch.device("meta"), "no")
    model = torch.nn.Linear(2, 2)
    optimizer, train_dl, eval_dl = object(), object(), object()
    assert amp.prepare(model, optimizer, train_dl, eval_dl) == (model, optimizer, train_dl, eval_dl)
    assert model.weight.device.type == "meta"
    batch = amp.to_device({"input_ids": torch.ones(2, 3), "labels": torch.zeros(2)})
    assert {t.device.type for t in batch.values()} == {"meta"}
    assert amp.is_main_process


def test_torch_amp_leaves_fsdp_shards_where_fully_shard_put_them(group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fully_shard(model)
    TorchAmp(torch.device("meta"), "no").prepare(model, None, None, None)
    assert isinstance(model[0].weight, DTensor) and model[0].weight.device.type == "cpu"


@pytest.mark.parametrize(
    ("precision", "dtype"), [("no", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_torch_amp_autocasts_at_its_precision_only(precision, dtype):
    amp = TorchAmp(torch.device("cpu"), precision)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # "no" opens no fp32 autocast region for torch to refuse with a warning
        with amp.autocast():
            out = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
            enabled = torch.is_autocast_enabled("cpu")
    assert out.dtype == (dtype or torch.float32)
    assert enabled is (dtype is not None)  # "no": no autocast region at all (an outer one still rules)
    assert amp.eval_args() == {"precision": precision}


def _one_weight_step(
    amp: TorchAmp, gradient: float, history: History | None = None
) -> tuple[torch.nn.Parameter, History, float]:
    """One step of SGD(lr=1) on one weight w=1 whose loss is ``gradient * w``: its gradient is known."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    history = History(config={}) if history is None else history
    amp.backward((weight * gradient).sum())
    scaled = weight.grad.item()
    amp.unscale(optimizer)
    amp.step(optimizer, history)
    return weight, history, scaled


def test_fp16_scales_the_loss_unscales_the_gradients_and_records_the_scale():
    amp = TorchAmp(torch.device("cpu"), "fp16")
    assert amp.scaler.is_enabled()
    scale = amp.scaler.get_scale()
    weight, history, scaled = _one_weight_step(amp, 0.5)
    assert scaled == pytest.approx(0.5 * scale)  # backward saw the scaled loss
    assert weight.item() == pytest.approx(0.5)  # the step used the true gradient
    assert history.scaler_scales == [amp.scaler.get_scale()] and history.skipped_steps == 0


def test_fp16_skips_a_step_with_an_inf_gradient_and_counts_it():
    amp = TorchAmp(torch.device("cpu"), "fp16")
    scale = amp.scaler.get_scale()
    weight, history, _ = _one_weight_step(amp, float("inf"))
    assert weight.item() == 1.0  # not updated
    assert history.skipped_steps == 1
    assert history.scaler_scales == [scale / 2]
    _one_weight_step(amp, 0.5, history)  # a good step, then a second skipped one: the count adds up
    _one_weight_step(amp, float("nan"), history)
    assert history.skipped_steps == 2
    assert history.scaler_scales == [scale / 2, scale / 2, scale / 4]


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_without_fp16_there_is_no_loss_scaling(precision):
    amp = TorchAmp(torch.device("cpu"), precision)
    assert not amp.scaler.is_enabled()
    weight, history, scaled = _one_weight_step(amp, 0.5)
    assert scaled == 0.5 and weight.item() == pytest.approx(0.5)
    assert history.scaler_scales == [] and history.skipped_steps == 0
    # an inf gradient is not skipped by anything without a scaler: the weight becomes non-finite
    weight, history, _ = _one_weight_step(amp, float("inf"))
    assert not torch.isfinite(weight).all() and history.skipped_steps == 0


# ----------------------------------------------------------------------------------------------
# activation_checkpointing.py


def test_checkpointing_turns_on_and_off_and_returns_the_model():
    model = _distilbert()
    assert enable_checkpointing(model) is model and model.is_activation_checkpointing
    assert enable_checkpointing(model, False) is model and not model.is_activation_checkpointing
    assert enable_checkpointing(model, False) is model and not model.is_activation_checkpointing


def test_checkpointed_layers_still_learn_when_their_inputs_need_no_gradient():
    """use_reentrant=False: with frozen embeddings (the layers' inputs need no gradient), the reentrant
    implementation would silently give the checkpointed layers no gradient at all."""
    model = enable_checkpointing(_distilbert()).train()
    model.distilbert.embeddings.requires_grad_(False)
    model(**_tokens()).loss.backward()
    layer = model.distilbert.transformer.layer[0]
    assert layer.attention.q_lin.weight.grad is not None
    assert layer.attention.q_lin.weight.grad.abs().sum() > 0


def test_checkpointed_gradients_can_be_taken_with_autograd_grad():
    """use_reentrant=False: ``torch.autograd.grad`` (a gradient penalty, a per-parameter probe) works
    through checkpointed layers; the reentrant implementation reports the layers as unused."""
    model = enable_checkpointing(_distilbert()).train()
    weight = model.distilbert.transformer.layer[0].ffn.lin1.weight
    (grad,) = torch.autograd.grad(model(**_tokens()).loss, [weight])
    assert grad.abs().sum() > 0


def test_checkpointing_gives_the_same_gradients():
    batch = _tokens()
    grads = []
    for enabled in (False, True):
        model = enable_checkpointing(_distilbert(), enabled).train()
        model.config.dropout = model.config.attention_dropout = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        model(**batch).loss.backward()
        grads.append(model.distilbert.transformer.layer[0].ffn.lin1.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_a_model_without_checkpointing_is_refused_only_when_it_is_asked_for():
    model = torch.nn.Linear(2, 2)
    assert enable_checkpointing(model, False) is model
    with pytest.raises(ValueError, match="Linear does not support gradient checkpointing"):
        enable_checkpointing(model)


# ----------------------------------------------------------------------------------------------
# slides.py: the slides' loops


class Tagger(torch.nn.Module):
    """``model(input_ids, attention_mask=..., labels=...)`` as the slides call it: a linear classifier
    of the mean of the masked inputs; counts its forwards in training mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 2)
        self.training_forwards = 0

    def forward(self, input_ids, attention_mask, labels):
        self.training_forwards += int(self.training)
        x = (input_ids * attention_mask.unsqueeze(-1)).mean(1)
        logits = self.linear(x)
        return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits.float(), labels))


def _tagger_batches(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": 10 * torch.randn(4, 5, 3, generator=g),  # large inputs: gradients get clipped
            "attention_mask": (torch.rand(4, 5, generator=g) > 0.3).float(),
            "labels": torch.randint(0, 2, (4,), generator=g),
        }
        for _ in range(n)
    ]


def _by_hand(batches, max_norm):
    """The slide's loop without mixed precision, written out: the reference both loops must match."""
    model = Tagger().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    losses, norms = [], []
    for batch in batches:
        loss = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))


@pytest.mark.parametrize("max_norm", [None, 1.0, 0.05])
def test_the_slide_loop_in_pytorch_trains_as_written_out_by_hand(max_norm):
    """None: the slide's default, max_norm=1.0."""
    batches = _tagger_batches()
    expected, losses, norms = _by_hand(batches, max_norm or 1.0)
    assert max(norms) > 2 * (max_norm or 1.0)  # clipping changes steps, at this norm and at twice it
    model = Tagger().eval()
    steps = []
    clip = {} if max_norm is None else {"max_norm": max_norm}
    got, scaler = train_pytorch(model, batches, *_sgd(model), "no", on_step=lambda: steps.append(1), **clip)
    assert got == pytest.approx(losses)
    assert model.training and model.training_forwards == len(batches)
    assert len(steps) == len(batches)
    torch.testing.assert_close(model.linear.weight, expected.linear.weight)
    assert not scaler.is_enabled()


def test_the_slide_loop_in_pytorch_scales_fp16_from_the_initial_scale_asked_for():
    model = Tagger()
    _, scaler = train_pytorch(model, _tagger_batches(2), *_sgd(model), "fp16", init_scale=2.0**10)
    assert scaler.is_enabled()
    assert scaler.get_scale() in (2.0**10, 2.0**9, 2.0**8)  # halved on a skipped step, never raised in 2
    _, default = train_pytorch(model, _tagger_batches(1), *_sgd(model), "fp16")
    assert default.get_scale() >= 2.0**15


def test_the_slide_loop_autocasts_at_the_precision_asked_for():
    seen = []

    class Watching(Tagger):
        def forward(self, input_ids, attention_mask, labels):
            out = super().forward(input_ids, attention_mask, labels)
            seen.append(out.logits.dtype)
            return out

    for precision in ("no", "bf16", "fp16"):
        model = Watching()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "no": no fp32 autocast region for torch to refuse with a warning
            train_pytorch(model, _tagger_batches(1), *_sgd(model), precision)
    assert seen == [torch.float32, torch.bfloat16, torch.float16]


def test_the_slide_loop_in_pytorch_moves_each_batch_to_the_model_s_device(monkeypatch):
    """On a CPU-only machine every tensor is already on the model's device, so the move is watched: each
    batch goes through ``to_device`` to the device of the model's parameters (cuda:0 on a GPU)."""
    from course_lib.training import slides

    moved, real = [], slides.to_device

    def watched(batch, device):
        moved.append(device)
        return real(batch, device)

    monkeypatch.setattr(slides, "to_device", watched)
    model = Tagger()
    train_pytorch(model, _tagger_batches(2), *_sgd(model), "no")
    assert moved == [torch.device("cpu")] * 2


class PlainAccelerator:
    """What ``train_accelerate`` calls on an Accelerator, for one process in fp32."""

    def __init__(self) -> None:
        self.backwards = 0

    def backward(self, loss):
        self.backwards += 1
        loss.backward()

    def clip_grad_norm_(self, parameters, max_norm):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm=max_norm)


@pytest.mark.parametrize("max_norm", [None, 1.0, 0.05])
def test_the_slide_loop_with_an_accelerator_trains_as_written_out_by_hand(max_norm):
    batches = _tagger_batches()
    expected, losses, norms = _by_hand(batches, max_norm or 1.0)
    assert max(norms) > 2 * (max_norm or 1.0)
    model = Tagger().eval()
    accelerator, steps = PlainAccelerator(), []
    clip = {} if max_norm is None else {"max_norm": max_norm}
    got = train_accelerate(accelerator, model, batches, *_sgd(model), on_step=lambda: steps.append(1), **clip)
    assert got == pytest.approx(losses)
    assert model.training and accelerator.backwards == len(batches) == len(steps)
    torch.testing.assert_close(model.linear.weight, expected.linear.weight)


# ----------------------------------------------------------------------------------------------
# local_sgd.py: the switch to Accelerate's LocalSGD


class AveragingAccelerator:
    """An Accelerator of several CPU processes as LocalSGD sees it: records each averaging (one
    ``reduce(..., "mean")`` per parameter after ``wait_for_everyone``)."""

    def __init__(self) -> None:
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.MULTI_CPU
        self.averaged: list[int] = []
        self.step = 0

    def wait_for_everyone(self):
        self.averaged.append(self.step)

    def autocast(self):
        return nullcontext()

    def reduce(self, tensor, reduction):
        assert reduction == "mean"
        return tensor


class NoSyncModel(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.in_no_sync = False

    @contextmanager
    def no_sync(self):
        self.in_no_sync = True
        yield
        self.in_no_sync = False


@pytest.mark.parametrize(("start_step", "expected"), [(0, [3, 6, 7]), (3, [6, 7]), (4, [6, 7])])
def test_local_sgd_averages_every_n_steps_of_the_whole_run_and_once_at_the_end(start_step, expected):
    """Steps start_step+1 .. 7 with local_sgd_steps=3: averaged after steps 3 and 6 of the run (a resumed
    run keeps that schedule) and once more on leaving the block; DDP's all-reduce off meanwhile."""
    accelerator, model = AveragingAccelerator(), NoSyncModel()
    backend = SimpleNamespace(accelerator=accelerator)
    with local_sgd(backend, model, 3, start_step=start_step) as averager:
        assert model.in_no_sync
        for step in range(start_step + 1, 8):
            accelerator.step = step
            averager.step()
    assert accelerator.averaged == expected
    assert not model.in_no_sync


def test_local_sgd_starts_its_schedule_at_step_zero_and_accepts_a_period_of_one():
    accelerator = AveragingAccelerator()
    with local_sgd(SimpleNamespace(accelerator=accelerator), NoSyncModel(), 3) as averager:
        for step in range(1, 8):
            accelerator.step = step
            averager.step()
    assert accelerator.averaged == [3, 6, 7]
    accelerator = AveragingAccelerator()
    with local_sgd(SimpleNamespace(accelerator=accelerator), NoSyncModel(), 1) as averager:
        for step in range(1, 4):
            accelerator.step = step
            averager.step()
    assert accelerator.averaged == [1, 2, 3, 3]


def test_local_sgd_does_nothing_for_a_backend_without_an_accelerator():
    with local_sgd(SimpleNamespace(), NoSyncModel(), 3) as averager:  # TorchAmp has no accelerator
        averager.step()
    assert averager.num_steps == 0


@pytest.mark.parametrize("steps", [None, 3])
def test_local_sgd_does_nothing_when_off_or_without_an_accelerator(steps):
    accelerator = AveragingAccelerator()
    backend = SimpleNamespace(accelerator=accelerator if steps is None else None)
    with local_sgd(backend, NoSyncModel(), steps) as averager:
        for _ in range(6):
            averager.step()
    assert accelerator.averaged == [] and averager.num_steps == 0


@pytest.mark.parametrize("steps", [0, -2])
def test_local_sgd_refuses_a_period_under_one(steps):
    with pytest.raises(ValueError, match=f"local_sgd_steps must be >= 1 \\(or None for off\\), got {steps}"):
        local_sgd(SimpleNamespace(accelerator=AveragingAccelerator()), NoSyncModel(), steps)
