"""Behaviours of ``course_lib.training.fsdp`` that mutation testing found unguarded (docs/mutation.md).

Real FSDP2 (``fully_shard``) on CPU, in this process (mutmut sees no code run in torchrun's children):
which accelerators shard in ``prepare`` themselves, which ``ModuleList`` holds the blocks ``shard_model``
shards one by one, when ``shard_model`` and ``require_sharded`` leave a model alone or refuse it, what
``reshard_after_forward`` leaves registered between a forward and its backward, the elements and full
state dicts each of two ranks gets, and what ``load_full_state`` restores or refuses.

Most tests run in a one-process gloo group (the ``group`` fixture). What only several ranks show (a rank's
shard is half the model; the full state dicts reach rank 0 only) runs on two ranks in two threads of this
process, over PyTorch's in-process ``threaded`` process group (``_on_two_ranks``): the same FSDP2 code and
collectives, with no second process.
"""

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from test_core_checkpoints import Blocks  # two blocks in a ModuleList and a head: 50 parameters

from course_lib.training import fsdp


def _accelerator(kind: DistributedType) -> SimpleNamespace:
    """What ``fsdp`` reads of an Accelerator: its ``distributed_type`` (Accelerate's own enum)."""
    return SimpleNamespace(distributed_type=kind)


def _kinds(model: torch.nn.Module) -> dict[str, str]:
    """The class of each parameter registered on the model now: DTensor (a shard) or Parameter (gathered)."""
    return {name: type(p).__name__ for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# accelerator_shards


@pytest.mark.parametrize(
    "accelerator, shards",
    [
        (_accelerator(DistributedType.FSDP), True),  # accelerate launch --use_fsdp: prepare shards
        (_accelerator(DistributedType.MULTI_GPU), False),  # DDP: the loop shards
        (_accelerator(DistributedType.NO), False),
        (SimpleNamespace(), False),  # an object without a distributed_type
        (SimpleNamespace(distributed_type="FSDP"), False),  # not Accelerate's enum: no .value
        (None, False),  # no Accelerator at all
    ],
)
def test_only_an_accelerator_whose_distributed_type_is_fsdp_shards_in_prepare(accelerator, shards):
    assert fsdp.accelerator_shards(accelerator) is shards


# ----------------------------------------------------------------------------------------------
# transformer_blocks


class _TwoLists(torch.nn.Module):
    """Three small modules in one ModuleList, two large ones in another, and a one-module ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])  # 18 parameters
        self.large = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])  # 40 parameters
        self.single = torch.nn.ModuleList([torch.nn.Linear(16, 16)])  # 272 parameters, but one module


def test_the_blocks_are_the_children_of_the_modulelist_with_the_most_parameters():
    model = _TwoLists()
    blocks = fsdp.transformer_blocks(model)
    assert isinstance(blocks, list) and [id(b) for b in blocks] == [id(b) for b in model.large]


def test_a_modulelist_of_one_module_is_no_list_of_blocks():
    model = torch.nn.Module()
    model.only = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="^Module has no ModuleList of blocks to shard one by one"):
        fsdp.transformer_blocks(model)


def test_a_model_without_blocks_is_refused_naming_its_class():
    with pytest.raises(ValueError, match="^Sequential has no ModuleList of blocks to shard one by one"):
        fsdp.transformer_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))


# ----------------------------------------------------------------------------------------------
# shard_model


def test_shard_model_leaves_a_model_to_an_accelerator_that_shards_it_even_without_a_process_group():
    """``accelerate launch --use_fsdp``: prepare shards; the loop neither shards nor asks for a group."""
    assert not dist.is_initialized()
    model = Blocks()
    assert fsdp.shard_model(model, accelerator=_accelerator(DistributedType.FSDP)) is model
    assert not fsdp.is_sharded(model) and set(_kinds(model).values()) == {"Parameter"}
    with pytest.raises(ValueError, match="none is running"):  # any other accelerator: the loop shards
        fsdp.shard_model(model, accelerator=_accelerator(DistributedType.MULTI_GPU))


def test_shard_model_leaves_a_sharded_model_as_it_is(group):
    model = fsdp.shard_model(Blocks())
    before = {name: id(p) for name, p in model.named_parameters()}
    assert fsdp.shard_model(model) is model  # no second fully_shard (which would fail)
    assert {name: id(p) for name, p in model.named_parameters()} == before
    model(torch.randn(3, 4)).sum().backward()  # and it still trains


def test_by_default_every_block_and_the_model_free_their_gathered_parameters_after_forward(group):
    """Between a forward and its backward, the registered parameters are the shards (DTensor) again:
    each block's, and the model's own (the head), which the model's ``fully_shard`` holds."""
    model = fsdp.shard_model(Blocks())
    assert set(_kinds(model).values()) == {"DTensor"}
    loss = model(torch.randn(3, 4)).sum()
    assert set(_kinds(model).values()) == {"DTensor"}, _kinds(model)
    loss.backward()
    assert set(_kinds(model).values()) == {"DTensor"}


def test_without_reshard_after_forward_every_block_and_the_model_keep_them_gathered_until_backward(group):
    model = fsdp.shard_model(Blocks(), reshard_after_forward=False)
    assert set(_kinds(model).values()) == {"DTensor"}
    loss = model(torch.randn(3, 4)).sum()
    assert set(_kinds(model).values()) == {"Parameter"}, _kinds(model)  # unsharded: no all-gather again
    loss.backward()
    assert set(_kinds(model).values()) == {"DTensor"}  # resharded once the backward is done


# ----------------------------------------------------------------------------------------------
# require_sharded


@pytest.mark.parametrize(
    "enabled, sharded, accelerator, refused",
    [
        (False, False, None, False),  # no fsdp: any optimizer will do
        (True, False, None, True),  # fsdp, and the optimizer was built on the unsharded parameters
        (True, True, None, False),  # built after sharding (build_optimizer)
        (True, False, DistributedType.FSDP, False),  # the accelerator shards both in prepare
        (True, False, DistributedType.MULTI_GPU, True),
    ],
)
def test_require_sharded_refuses_only_an_optimizer_built_before_the_loop_shards(
    group, enabled, sharded, accelerator, refused
):
    model = fsdp.shard_model(Blocks()) if sharded else Blocks()
    acc = None if accelerator is None else _accelerator(accelerator)
    if refused:
        with pytest.raises(ValueError, match="build_optimizer"):
            fsdp.require_sharded(model, enabled, acc)
    else:
        fsdp.require_sharded(model, enabled, acc)


# ----------------------------------------------------------------------------------------------
# local_numel and full_state, on two ranks


def _on_two_ranks(fn) -> list:
    """``fn(rank)`` on ranks 0 and 1 of a two-rank process group, in two threads of this process
    (PyTorch's in-process ``threaded`` backend, as its own distributed tests use); returns the results
    by rank, and raises what a rank raised."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    assert not dist.is_initialized()
    results: list = [None, None]
    errors: list[BaseException] = []
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # wake the other rank from its collective, then report
            errors.append(error)
            ProcessLocalGroup.exception_handle(error)
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank hung in a collective"
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results


def test_local_numel_counts_everything_of_an_unsharded_model():
    assert fsdp.local_numel(Blocks()) == 50


def test_each_of_two_ranks_holds_half_the_elements_of_the_sharded_model():
    replicas = [Blocks(), Blocks()]  # built here: the threads share the global random generator
    held = _on_two_ranks(lambda rank: fsdp.local_numel(fsdp.shard_model(replicas[rank])))
    assert held == [25, 25]  # each Linear's rows split in two: 50 elements in all


def test_the_full_state_dicts_reach_rank_0_only_whole_and_the_other_ranks_get_empty_ones():
    replicas = [Blocks(), Blocks()]
    expected = {k: v.clone() for k, v in Blocks().state_dict().items()}
    x = torch.randn(3, 4)

    def states(rank: int):
        model = fsdp.shard_model(replicas[rank])
        only_model = fsdp.full_state(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(x).sum().backward()
        optimizer.step()
        return only_model, fsdp.full_state(model, optimizer)

    (model_0, (after_0, optimizer_0)), (model_1, (after_1, optimizer_1)) = _on_two_ranks(states)
    assert model_0[1] == {} and model_0[0].keys() == expected.keys()  # without an optimizer: {}
    assert all(torch.equal(model_0[0][k], v) for k, v in expected.items())  # whole, not rank 0's half
    assert all(v.device.type == "cpu" and not hasattr(v, "to_local") for v in model_0[0].values())
    assert after_0.keys() == expected.keys() and not all(
        torch.equal(after_0[k], expected[k]) for k in expected
    )
    assert optimizer_0["state"].keys() == set(expected)  # moments by parameter name, full size
    assert all(optimizer_0["state"][k]["exp_avg"].shape == v.shape for k, v in expected.items())
    assert model_1 == ({}, {}) and after_1 == {} and optimizer_1 == {}  # the other rank: empty


# ----------------------------------------------------------------------------------------------
# load_full_state


def _trained(seed: int, groups: int = 1, scheduler: bool = False):
    model = fsdp.shard_model(Blocks(seed))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": params[:2]}, {"params": params[2:]}] if groups == 2 else params, lr=0.1
    )
    if scheduler:
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # adds initial_lr to each group
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_resumed_optimizer_gets_the_scheduler_keys_its_groups_lacked_and_a_scheduler_resumes(group):
    """A scheduler added ``initial_lr`` to the saved groups; the fresh optimizer, built without one, gets
    it (and the saved ``lr``), so that the run's scheduler can be rebuilt at the saved step."""
    saved_model, saved_optimizer = _trained(seed=0, scheduler=True)
    model_state, optimizer_state = fsdp.full_state(saved_model, saved_optimizer)
    model, optimizer = _trained(seed=1)
    optimizer.param_groups[0]["lr"] = 0.7
    assert "initial_lr" not in optimizer.param_groups[0]
    expected = copy.deepcopy(
        (model_state, optimizer_state)
    )  # set_state_dict turns the dicts' tensors into shards
    fsdp.load_full_state(model, optimizer, model_state, optimizer_state)
    group_ = optimizer.param_groups[0]
    assert (group_["initial_lr"], group_["lr"]) == (0.1, 0.05)
    assert len(group_["params"]) == 6 and all(isinstance(p, torch.Tensor) for p in group_["params"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5, last_epoch=1)
    assert scheduler.base_lrs == [0.1]
    loaded = fsdp.full_state(model, optimizer)
    assert loaded[0].keys() == expected[0].keys()
    assert all(torch.equal(loaded[0][k], v) for k, v in expected[0].items())
    moments = expected[1]["state"]
    assert loaded[1]["state"].keys() == moments.keys()
    assert all(torch.equal(loaded[1]["state"][k]["exp_avg"], v["exp_avg"]) for k, v in moments.items())


@pytest.mark.parametrize("saved_groups, groups", [(1, 2), (2, 1)])
def test_a_saved_state_with_another_number_of_param_groups_is_refused(group, saved_groups, groups):
    """``set_state_dict`` alone would load it silently, the groups' settings mixed up."""
    model_state, optimizer_state = fsdp.full_state(*_trained(seed=0, groups=saved_groups))
    model, optimizer = _trained(seed=1, groups=groups)
    with pytest.raises(ValueError, match="zip"):
        fsdp.load_full_state(model, optimizer, model_state, optimizer_state)
