"""Lesson 03's demonstrations (``course_lib.apparatus.mixed_precision``) on a two-layer model."""

from types import SimpleNamespace

import pytest
import torch

from course_lib.apparatus import mixed_precision as mpd
from course_lib.mixed_precision import advise_precision


class TwoLinears(torch.nn.Module):
    """Two ``nn.Linear`` layers and a loss: what autocast casts, and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x, labels):
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.b(self.a(x).relu()), labels))


def batch():
    torch.manual_seed(0)
    # x requires grad, like the embeddings a Transformer's first Linear reads: backward needs every weight
    return {"x": torch.randn(4, 8, requires_grad=True), "labels": torch.tensor([0, 1, 2, 0])}


def test_autocast_saves_one_cached_copy_per_weight_matrix():
    model = TwoLinears()
    cached = mpd.autocast_weight_copies(model, batch(), "bf16")
    assert cached == {"copies": 2, "bytes": (8 * 16 + 16 * 3) * 2, "reused": True}
    uncached = mpd.autocast_weight_copies(model, batch(), "bf16", cache_enabled=False)
    assert uncached["copies"] == 2 and uncached["reused"] is False
    assert all(p.grad is None for p in model.parameters())  # left as it was found


def test_bf16_loses_updates_up_to_half_an_eps_near_one():
    half_eps = torch.finfo(torch.bfloat16).eps / 2  # 2^-8: a tie, rounded to the even 1.0
    assert mpd.lost_update(1.0, half_eps, torch.bfloat16)["lost"]
    assert not mpd.lost_update(1.0, half_eps * 1.01, torch.bfloat16)["lost"]
    assert not mpd.lost_update(1.0, 1e-3, torch.float32)["lost"]


def test_saved_bytes_tell_parameters_saved_as_is_from_new_tensors():
    model = TwoLinears()
    fp32 = mpd.saved_activation_bytes(model, batch(), "no")
    bf16 = mpd.saved_activation_bytes(model, batch(), "bf16")
    # fp32: linear keeps its fp32 weights as they are (no new memory); under autocast their bf16 copies
    assert fp32["parameters"] == {"float32": (8 * 16 + 16 * 3) * 4}
    assert bf16["parameters"] == {}
    assert set(fp32["new"]) <= {"float32", "int64"} and "bfloat16" in bf16["new"]
    assert bf16["new"]["bfloat16"] >= (8 * 16 + 16 * 3) * 2  # the copies are new tensors
    assert all(p.grad is None for p in model.parameters())


def test_cpu_verdict_follows_the_training_step_not_the_matmul_alone():
    def advice(bf16, fp16=None):
        speeds = {"no": 1.0, "bf16": bf16} | ({} if fp16 is None else {"fp16": fp16})
        return advise_precision("cpu", speeds)

    amx = mpd.cpu_verdict_sentences(advice(3.2, 0.9), advice(1.5, 0.8))
    assert "BF16 の混合精度を選びます" in amx[0] and "1.50 倍" in amx[0]
    assert "FP16 は行列積で FP32 の 0.90 倍" in amx[1]
    small_model = mpd.cpu_verdict_sentences(advice(3.2), advice(1.05))
    assert "1.05 倍" in small_model[0] and "届きません" in small_model[0] and len(small_model) == 1
    assert "コースは FP32 を選びます" in small_model[0] and "最速" not in small_model[0]
    no_bf16 = mpd.cpu_verdict_sentences(advice(0.3, 0.01), advice(0.6, 0.09))
    assert "コースは FP32 を選びます" in no_bf16[0]
    with pytest.raises(ValueError, match="bf16"):
        mpd.cpu_verdict_sentences(advice(3.2), advise_precision("cpu", {"no": 1.0}))


@pytest.mark.parametrize(
    ("quartiles", "where"),
    [((0.98, 1.10), "より上"), ((1.20, 1.40), "より下"), ((1.0, 1.3), "範囲の中")],
)
def test_the_verdict_says_where_the_threshold_lies_in_the_spread_of_the_rounds(quartiles, where):
    sentences = mpd.cpu_verdict_sentences(
        advise_precision("cpu", {"no": 1.0, "bf16": 3.0}),
        advise_precision("cpu", {"no": 1.0, "bf16": 1.1}),
        bf16_step_quartiles=quartiles,
    )
    assert f"{quartiles[0]:.2f}〜{quartiles[1]:.2f} 倍" in sentences[1] and where in sentences[1]


def test_round_speedups_pair_each_round_and_drop_the_warm_up():
    assert mpd.round_speedups([9.0, 2.0, 3.0], [1.0, 1.0, 2.0]) == [2.0, 1.5]


def test_comm_demo_refuses_an_unknown_hook():
    with pytest.raises(ValueError, match="Unknown hook"):
        mpd.CommDemo(hooks=("fp32", "int8"))


@pytest.mark.slow  # two real processes
def test_the_fp16_hook_sends_half_the_bytes_and_the_ranks_stay_equal():
    from course_lib.distributed import launch

    ranks = launch(mpd.comm_worker, 2, args=(mpd.CommDemo(steps=1, global_batch=4),), backend="gloo")
    for rows in ranks:
        fp32, fp16 = rows
        assert fp32["dtypes"] == ["float32"] and fp16["dtypes"] == ["float16"]
        assert fp32["bytes_per_step"] == 4 * fp32["parameters"] == 2 * fp16["bytes_per_step"]
    for a, b in zip(*ranks):
        assert torch.equal(a["params_after"], b["params_after"])
