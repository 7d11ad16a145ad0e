"""course_lib.instruments.replicas: the replicas' distance and a loss over the ranks, in a one-process
gloo group (a FileStore: no network); lesson 05's two-rank launch (tests/test_apparatus_local_sgd.py)
measures two replicas apart."""

from types import SimpleNamespace

import pytest
import torch

from course_lib.distributed import flat_params
from course_lib.instruments.comm import counting_collectives
from course_lib.instruments.replicas import mean_loss_over_ranks, replica_drift


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(4, 2), torch.nn.Dropout(0.5)

    def forward(self, x, labels):
        logits = self.lin(self.drop(x))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels))


def test_replica_drift_of_one_replica_is_its_own_move(group):
    torch.manual_seed(0)
    model = _Classifier()
    anchor = flat_params(model)
    with torch.no_grad():
        model.lin.weight.add_(0.5)  # 8 weights moved by 0.5: |move| = sqrt(8) / 2
    with counting_collectives() as log:
        drift = replica_drift(model, anchor)
    assert drift["distance"] == 0.0  # one replica is in sync with itself
    assert drift["moved"] == pytest.approx(8**0.5 / 2)
    assert drift["cosine"] == pytest.approx(1.0)  # the move compared with itself
    assert sum(log.calls.values()) == 0  # the list-form all_gather: never counted as traffic
    assert replica_drift(model, flat_params(model))["moved"] == 0.0


def test_mean_loss_over_ranks_is_the_eval_mode_loss_and_leaves_the_model_training(group):
    torch.manual_seed(0)
    model = _Classifier()
    batch = {"x": torch.randn(6, 4), "labels": torch.tensor([0, 1, 1, 0, 1, 0])}
    model.eval()
    expected = model(**batch).loss.item()  # no dropout
    model.train()
    assert mean_loss_over_ranks(model, batch) == pytest.approx(expected, rel=1e-6)
    assert model.training
