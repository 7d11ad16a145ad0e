"""course_lib.apparatus.data_parallel: lesson 02's evaluation with Accelerate, checked on two real processes.

The two-process test (``test_two_ranks_prepare_wraps_in_ddp_and_gather_for_metrics_drops_the_padding``)
is in the slow tier.
"""

import pytest
import torch

from course_lib.apparatus import data_parallel as DP
from course_lib.distributed import launch
from course_lib.training.metrics import accuracy_f1


@pytest.mark.parametrize("kwargs", [{"rows": 0}, {"batch_size": 0}])
def test_eval_demo_rejects_empty_sizes(kwargs):
    with pytest.raises(ValueError, match="rows and batch_size must be >= 1"):
        DP.EvalDemo(**kwargs)


def test_eval_loader_reads_each_row_once_in_order():
    demo = DP.EvalDemo(rows=5, batch_size=2)
    sizes = [len(batch["labels"]) for batch in DP.eval_loader(demo)]
    assert sizes == [2, 2, 1]
    one = DP.single_process_predictions(demo)
    assert one["preds"].shape == one["labels"].shape == (5,)


@pytest.mark.slow  # two real processes
def test_two_ranks_prepare_wraps_in_ddp_and_gather_for_metrics_drops_the_padding():
    demo = DP.EvalDemo(rows=5, batch_size=2)  # 2 ranks x 2 rows: the third round has 1 row for 4 places
    ranks = launch(DP.accelerate_worker, 2, args=(demo,), backend="gloo")
    assert [r["type_before"] for r in ranks] == ["DistilBertForSequenceClassification"] * 2
    assert [r["type_after"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert all(r["same_params_all_ranks"] for r in ranks)
    assert torch.equal(ranks[1]["params_start"], ranks[0]["params_own_init"])  # rank 0's weights everywhere
    read = [row for r in ranks for batch in r["rows_read"] for row in batch]
    assert set(read) == set(range(5)) and len(read) > 5  # every row, and some twice as padding
    assert len({len(r["rows_read"]) for r in ranks}) == 1  # the same number of batches on each rank
    one = DP.single_process_predictions(demo)
    for r in ranks:
        assert len(r["gather_preds"]) == len(read) and len(r["metrics_preds"]) == 5
        assert torch.equal(r["metrics_preds"], one["preds"]) and torch.equal(
            r["metrics_labels"], one["labels"]
        )
        assert accuracy_f1(r["metrics_preds"], r["metrics_labels"]) == accuracy_f1(
            one["preds"], one["labels"]
        )


@pytest.mark.slow  # two real processes
def test_one_ddp_step_by_hand_equals_ddp_and_one_process_on_the_whole_batch():
    demo = DP.StepDemo(global_batch=4, lr=0.5)
    r0, r1 = launch(DP.ddp_step_worker, 2, args=(demo,), backend="gloo")
    assert sorted(r0["rows"] + r1["rows"]) == [0, 1, 2, 3]
    assert not torch.equal(r0["params_own_init"], r1["params_own_init"])  # the seeds really differed
    assert torch.equal(r1["params_start"], r0["params_own_init"])  # DDP broadcast rank 0's
    assert not torch.equal(r0["grad_local"], r1["grad_local"])
    mean_local = (r0["grad_local"] + r1["grad_local"]) / 2
    torch.testing.assert_close(r0["grad_averaged"], mean_local, rtol=1e-5, atol=1e-7)
    assert torch.equal(r0["grad_averaged"], r1["grad_averaged"])
    torch.testing.assert_close(r0["grad_ddp"], r0["grad_averaged"], rtol=1e-5, atol=1e-7)
    assert r0["same_params_all_ranks"] and torch.equal(r0["params_after"], r1["params_after"])
    assert not torch.equal(r0["params_after"], r0["params_start"])  # the step did move them
    torch.testing.assert_close(r0["params_after_rank0_update"], r0["params_after"], rtol=1e-5, atol=1e-7)
    one = DP.single_process_step(demo)
    torch.testing.assert_close(r0["params_after"], one["params_after"], rtol=1e-4, atol=1e-6)
