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


def test_saved_activation_bytes_are_smaller_under_autocast():
    model = TwoLinears()
    fp32 = mpd.saved_activation_bytes(model, batch(), "no")
    bf16 = mpd.saved_activation_bytes(model, batch(), "bf16")
    assert set(fp32) <= {"float32", "int64"} and "bfloat16" in bf16


def test_cpu_verdict_follows_the_training_step_not_the_matmul_alone():
    def advice(bf16, fp16=None):
        speeds = {"no": 1.0, "bf16": bf16} | ({} if fp16 is None else {"fp16": fp16})
        return advise_precision("cpu", speeds)

    amx = mpd.cpu_verdict_sentences(advice(3.2, 0.9), advice(1.5, 0.8))
    assert "得です" in amx[0] and "1.50 倍" in amx[0] and "FP16 は行列積で FP32 の 0.90 倍" in amx[1]
    small_model = mpd.cpu_verdict_sentences(advice(3.2), advice(0.8))
    assert "得になっていません" in small_model[0] and len(small_model) == 1
    no_bf16 = mpd.cpu_verdict_sentences(advice(0.3, 0.01), advice(0.6, 0.09))
    assert "FP32 のままが最速です" in no_bf16[0]
    with pytest.raises(ValueError, match="bf16"):
        mpd.cpu_verdict_sentences(advice(3.2), advise_precision("cpu", {"no": 1.0}))
