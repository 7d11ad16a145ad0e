"""Data parallelism with two real gloo processes: sharding, replication, aggregation, sync, accumulation."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from course_lib import data, models, training
from course_lib import distributed as D
from course_lib.apparatus import data_parallel as DP

ROWS = 8  # the global batch of the one-step checks: 2 ranks x 4 rows, or 2 ranks x 2 micro-batches x 2 rows
LR = 0.5


@pytest.mark.parametrize(
    "n, world_size, shuffle, drop_last, epoch",
    [
        (10, 2, False, False, 0),
        (11, 2, True, False, 3),
        (10, 3, True, False, 1),
        (10, 4, False, True, 0),
        (3, 4, True, False, 0),
    ],
)
def test_shard_indices_are_what_distributed_sampler_yields(n, world_size, shuffle, drop_last, epoch):
    for rank in range(world_size):
        sampler = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        mine = D.shard_indices(n, world_size, rank, shuffle=shuffle, seed=7, epoch=epoch, drop_last=drop_last)
        assert mine == list(sampler)


def test_shards_cover_every_sample_once_and_pad_as_documented():
    shards = [D.shard_indices(12, 3, r, shuffle=True, seed=1) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(12))  # no overlap, nothing dropped
    padded = [D.shard_indices(10, 4, r) for r in range(4)]  # 10 rows, 4 ranks: 3 each, 2 repeated
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    flat = sum(padded, [])
    assert sorted(set(flat)) == list(range(10)) and sorted(flat) == sorted(list(range(10)) + [0, 1])
    dropped = [D.shard_indices(10, 4, r, drop_last=True) for r in range(4)]  # the tail is dropped instead
    assert sorted(sum(dropped, [])) == list(range(8))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: D.shard_indices(10, 0, 0), ValueError, r"world_size must be an integer >= 1"),
        (lambda: D.shard_indices(10, 2, 2), ValueError, r"rank must be an integer in 0\.\.1 .* got 2"),
        (lambda: D.shard_indices(10, 2, -1), ValueError, r"rank must be an integer in 0\.\.1 .* got -1"),
        (lambda: D.shard_indices(-1, 2, 0), ValueError, r"n must be a non-negative number of samples"),
        (lambda: D.check_backend("mpi"), ValueError, r"Unsupported backend 'mpi': use 'gloo'"),
        (lambda: D.launch(DP.sharding_worker, world_size=0), ValueError, r"world_size must be .* got 0"),
        (lambda: D.launch(DP.sharding_worker, start_method="thread"), ValueError, r"start_method 'thread'"),
        (lambda: D.ShardedLoader([1, 2], batch_size=0), ValueError, r"batch_size must be >= 1"),
        (lambda: D.ShardedLoader([], batch_size=2), ValueError, r"empty dataset"),
        (lambda: D.same_on_all_ranks(torch.zeros(1)), RuntimeError, r"No torch.distributed process group"),
        (lambda: D.average_gradients(torch.nn.Linear(1, 1)), RuntimeError, r"inside a launched process"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run nccl with 2 processes")
def test_nccl_without_a_gpu_per_process_says_so():
    with pytest.raises(RuntimeError, match="one CUDA GPU per process"):
        D.check_backend("nccl", world_size=2)
    assert D.default_backend(2) == "gloo"


def test_a_notebook_function_cannot_be_spawned():
    def work(rank, world_size):
        return rank

    work.__module__ = "__main__"
    with pytest.raises(ValueError, match="cannot import it"):
        D.launch(work, world_size=2)


def test_signal_handlers_are_put_back():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with D.restore_signal_handlers():
        signal.signal(signal.SIGTERM, lambda *_: None)  # what torch's elastic launcher does
    assert signal.getsignal(signal.SIGTERM) is before


# --- two real processes ------------------------------------------------------------------------


def _rows():
    tokenizer = models.load_tokenizer("embedded")
    split = data.load_mrpc("embedded")["train"].select(range(ROWS))
    return data.tokenize_dataset(split, tokenizer), tokenizer


def _model(seed: int):
    torch.manual_seed(seed)
    return D.disable_dropout(models.load_model("embedded"))


def _one_step(model, loader, accelerator, grad_accum_steps: int) -> None:
    cfg = training.TrainConfig(
        max_steps=1, grad_accum_steps=grad_accum_steps, warmup_ratio=0, max_grad_norm=None, progress=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    training.train(model, loader, cfg, accelerator=accelerator, optimizer=optimizer)


def _checks_worker(rank: int, world_size: int) -> dict:
    """Runs in each of the two processes; what it returns is asserted on in the tests below."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from course_lib.cli import train as command

    out: dict = {}
    accelerator = command.make_accelerator(command.RunConfig(cpu=True, precision="no"))
    out["num_processes"] = accelerator.num_processes

    # Sharding: the command's loader over 11 rows (batch 3), two epochs.
    loader = D.ShardedLoader(list(range(11)), 3, world_size=world_size, rank=rank, seed=5)
    out["epochs"] = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        out["epochs"].append({"read": [b.tolist() for b in loader], "planned": loader.batch_indices()})

    # Replication: deliberately different seeds per rank; after prepare (DDP) every rank holds rank 0's.
    model = _model(seed=100 + rank)
    out["own_init"] = D.flat_params(model)
    accelerator.prepare(model)
    out["start"] = D.flat_params(model)
    out["start_same"] = D.same_on_all_ranks(out["start"])

    tokenized, tokenizer = _rows()
    collate = data.make_collator(tokenizer)

    def count_calls(calls: list):
        def hook(state, bucket):
            calls.append(1)
            return default_hooks.allreduce_hook(None, bucket)

        return hook

    # Aggregation and sync: one optimizer step, 4 rows per rank, through the course's training loop.
    for name, batch_size, accum in [("step", 4, 1), ("accum", 2, 2)]:
        model = accelerator.prepare(_model(seed=0))
        calls: list = []
        model.register_comm_hook(None, count_calls(calls))
        shard = D.ShardedLoader(tokenized, batch_size, collate, world_size, rank, shuffle=False)
        _one_step(model, shard, accelerator, accum)
        params = D.flat_params(model)
        out[name] = {
            "rows": shard.batch_indices(),
            "params": params,
            "same": D.same_on_all_ranks(params),
            "allreduce_calls": len(calls),
        }
    return out


@pytest.fixture(scope="module")
def ranks():
    return D.launch(_checks_worker, world_size=2, backend="gloo")


@pytest.fixture(scope="module")
def reference():
    """One process, all 8 rows in one batch, the same SGD step."""
    tokenized, tokenizer = _rows()
    model = _model(seed=0)
    loader = data.make_dataloader(tokenized, tokenizer, batch_size=ROWS)
    cfg = training.TrainConfig(max_steps=1, warmup_ratio=0, max_grad_norm=None, progress=False, device="cpu")
    training.train(model, loader, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    return D.flat_params(model)


@pytest.mark.slow  # two real processes (the module's `ranks` launch)
def test_two_processes_joined_one_group(ranks):
    assert [r["num_processes"] for r in ranks] == [2, 2]


@pytest.mark.slow  # two real processes (the module's `ranks` launch)
def test_sharding_every_sample_read_once_per_epoch_by_exactly_one_rank(ranks):
    for epoch in range(2):
        read = [r["epochs"][epoch]["read"] for r in ranks]
        assert read == [r["epochs"][epoch]["planned"] for r in ranks]  # batches match the sampler's plan
        rows = [sum(batches, []) for batches in read]
        assert [len(x) for x in rows] == [6, 6]  # 11 rows on 2 ranks: DistributedSampler pads to 12
        assert sorted(rows[0] + rows[1]) == sorted(list(range(11)) + [rows[0][0]])  # one row seen twice
        assert rows == [D.shard_indices(11, 2, r, shuffle=True, seed=5, epoch=epoch) for r in range(2)]
    assert ranks[0]["epochs"][0]["read"] != ranks[0]["epochs"][1]["read"]  # reshuffled each epoch


@pytest.mark.slow  # two real processes (the module's `ranks` launch)
def test_replication_all_ranks_start_from_rank_0s_parameters(ranks):
    assert not torch.equal(ranks[0]["own_init"], ranks[1]["own_init"])  # the seeds really differed
    assert torch.equal(ranks[0]["start"], ranks[1]["start"])
    assert torch.equal(ranks[1]["start"], ranks[0]["own_init"])
    assert ranks[0]["start_same"] and ranks[1]["start_same"]


@pytest.mark.slow  # two real processes (the module's `ranks` launch)
def test_one_step_identical_on_all_ranks_and_equal_to_one_process_on_the_whole_batch(ranks, reference):
    assert sorted(sum(ranks[0]["step"]["rows"] + ranks[1]["step"]["rows"], [])) == list(range(ROWS))
    assert torch.equal(ranks[0]["step"]["params"], ranks[1]["step"]["params"])
    assert ranks[0]["step"]["same"] and ranks[1]["step"]["same"]
    assert not torch.equal(ranks[0]["step"]["params"], ranks[0]["start"])  # the step did change them
    # Padding differs between a batch of 4 and one of 8; masked positions do not change the result.
    torch.testing.assert_close(ranks[0]["step"]["params"], reference, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # two real processes (the module's `ranks` launch)
def test_gradient_accumulation_under_ddp_skips_sync_and_equals_one_big_batch(ranks, reference):
    for r in ranks:
        assert len(r["accum"]["rows"]) == 2  # two micro-batches of 2 rows on each rank
        # Two backward passes, but only the last one all-reduced: as many hook calls as one backward.
        assert r["accum"]["allreduce_calls"] == r["step"]["allreduce_calls"] >= 1
    assert torch.equal(ranks[0]["accum"]["params"], ranks[1]["accum"]["params"])
    torch.testing.assert_close(ranks[0]["accum"]["params"], reference, rtol=1e-4, atol=1e-5)


# --- Trainer on two processes ----------------------------------------------------------------

TRAINER_ROWS, TRAINER_STEPS = 16, 2  # 2 optimizer steps of a global batch of 8 rows (2 x 4 on two ranks)


def _trainer_run(world_size: int, steps: int, fix: bool) -> dict:
    """``steps`` Trainer steps on the first rows: SGD, constant lr, no clipping, no accumulation, dropout off."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    split = data.load_mrpc("embedded")["train"].select(range(TRAINER_ROWS))
    tokenizer = models.load_tokenizer("embedded")
    model = _model(seed=0)
    start = D.flat_params(model)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=TRAINER_ROWS // TRAINER_STEPS // world_size,
            max_steps=steps,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,  # no clipping
            weight_decay=0.0,
            train_sampling_strategy="sequential",  # the same rows in the same order in both runs
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data.tokenize_dataset(split, tokenizer),
            data_collator=data.make_collator(tokenizer),
        )
        accepts = trainer.model_accepts_loss_kwargs
        if fix:  # the model averages its own loss and ignores num_items_in_batch: do not rescale it
            trainer.model_accepts_loss_kwargs = False
        trainer.train()
    return {
        "start": start,
        "params": D.flat_params(model),
        "accepts_loss_kwargs": accepts,
        "processes": trainer.accelerator.num_processes,
    }


def _trainer_worker(rank: int, world_size: int) -> dict:
    """Each rank: one Trainer step as configured by default, then TRAINER_STEPS steps with the fix."""
    return {
        "default_1": _trainer_run(world_size, 1, fix=False),
        "fixed": _trainer_run(world_size, TRAINER_STEPS, fix=True),
    }


def _trainer_reference_worker(rank: int, world_size: int) -> dict:
    """The same in one process (its own launch: Accelerate's state stays out of the test process)."""
    return {
        "default_1": _trainer_run(world_size, 1, fix=False),
        "steps": _trainer_run(world_size, TRAINER_STEPS, fix=False),
    }


@pytest.fixture(scope="module")
def trainer_runs():
    return {
        "two": D.launch(_trainer_worker, world_size=2, backend="gloo"),
        "one": D.launch(_trainer_reference_worker, world_size=1, backend="gloo")[0],
    }


@pytest.mark.slow  # three real processes
def test_two_process_trainer_equals_one_process_on_the_global_batch_once_it_stops_rescaling_the_loss(
    trainer_runs,
):
    two, one = trainer_runs["two"], trainer_runs["one"]
    assert [r["fixed"]["processes"] for r in two] == [2, 2] and one["steps"]["processes"] == 1
    assert torch.equal(two[0]["fixed"]["params"], two[1]["fixed"]["params"])
    assert not torch.equal(one["steps"]["params"], one["steps"]["start"])  # the steps did train
    # Padding differs between batches of 4 and of 8 rows; masked positions do not change the result.
    torch.testing.assert_close(two[0]["fixed"]["params"], one["steps"]["params"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # three real processes
def test_two_process_trainer_doubles_distilberts_update_by_default(trainer_runs):
    """transformers 5.24: DistilBERT's forward takes **kwargs, so Trainer multiplies the loss by the number
    of processes (average_tokens_across_devices) for a model that would divide by the global token count;
    DistilBERT returns its local mean, and DDP's average then gives twice the gradient."""
    two, one = trainer_runs["two"][0]["default_1"], trainer_runs["one"]["default_1"]
    assert two["accepts_loss_kwargs"] and one["accepts_loss_kwargs"]
    ratio = (two["params"] - two["start"]).norm() / (one["params"] - one["start"]).norm()
    assert abs(ratio.item() - 2.0) < 1e-3, ratio  # SGD, one step: the update is proportional to the gradient


def test_max_abs_diff_is_zero_for_empty_tensors_and_refuses_other_shapes():
    from course_lib.distributed import max_abs_diff

    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    assert max_abs_diff(torch.tensor([1.0, -2.0]), torch.tensor([1.5, 1.0])) == 3.0
    with pytest.raises(ValueError, match="Shapes differ"):
        max_abs_diff(torch.zeros(2), torch.zeros(3))


def test_disable_dropout_zeroes_the_modules_and_the_config():
    from course_lib.distributed import disable_dropout
    from course_lib.models import load_model

    model = disable_dropout(load_model())
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.dropout == model.config.attention_dropout == model.config.seq_classif_dropout == 0.0


def test_join_elastic_group_keeps_each_attempt_to_its_own_keys_in_the_agent_store():
    """torchrun's agent store outlives an attempt; the restarted group must not read the dead one's keys."""
    import datetime

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "WORLD_SIZE": "1", "RANK": "0"}
    assert not D.join_elastic_group("gloo", env)  # no agent store: Accelerate forms the group itself
    assert not dist.is_initialized()
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    try:
        assert D.join_elastic_group("gloo", env, timeout_s=30)
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert not D.join_elastic_group("gloo", env)  # a group exists: nothing to do
        keys = agent.list_keys()  # what the group's forming wrote: all under this attempt's prefix
        assert keys and all(k.startswith("course-attempt-1/") for k in keys), keys
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
