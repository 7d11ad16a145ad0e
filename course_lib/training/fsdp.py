"""[fsdp] Fully sharded data parallel: each of N ranks keeps 1/N of the parameters, gradients and
optimizer state, instead of DDP's full copy of each (ZeRO-3; lesson 06b).

``shard_model`` applies FSDP2's ``torch.distributed.fsdp.fully_shard`` in place: the parameters become
``DTensor`` shards. A block's backward reduce-scatters the gradients, so each rank gets the averaged
gradient of its own shard only. Build the optimizer after sharding: it must hold the shards, not the
parameters ``fully_shard`` replaced.

Who shards: the loop, on CPU processes (gloo) or GPUs without an FSDP plugin; an ``Accelerator`` whose
``distributed_type`` is FSDP (``accelerate launch --use_fsdp``, or ``Accelerator(fsdp_plugin=...)``,
GPUs only in Accelerate 1.15) shards in ``prepare`` itself, and the loop leaves it to it.

``full_state`` / ``load_full_state``: the model's and optimizer's full (unsharded) state dicts, through
``torch.distributed.checkpoint.state_dict``, for checkpoints that look like DDP's (``course_lib.checkpoints``).
"""

from __future__ import annotations

import torch


def _distributed_type(accelerator) -> str:
    return str(getattr(getattr(accelerator, "distributed_type", None), "value", "NO"))


def accelerator_shards(accelerator) -> bool:
    """Whether ``accelerator.prepare`` applies FSDP itself (an FSDP plugin on GPUs)."""
    return accelerator is not None and _distributed_type(accelerator) == "FSDP"


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``model`` (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of its largest ``ModuleList`` (by parameter count)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no ModuleList of blocks to shard one by one: pass a transformer "
            "(its layers in an nn.ModuleList), or call torch.distributed.fsdp.fully_shard yourself."
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def shard_model(
    model: torch.nn.Module,
    enabled: bool = True,
    accelerator=None,
    optimizer: torch.optim.Optimizer | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` each transformer block, then the model (in place); returns the model.

    Does nothing when ``enabled`` is False, when the model is sharded already, or when the
    ``accelerator`` shards in ``prepare``. Needs a process group (``torchrun``, ``distributed.launch``).
    ``optimizer``: one built on the unsharded parameters would update tensors FSDP no longer uses,
    so it is refused.
    """
    if not enabled or is_sharded(model) or accelerator_shards(accelerator):
        return model
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ValueError(
            "FSDP shards across the processes of a process group, and none is running: launch with "
            "torchrun --nproc-per-node N (or course_lib.distributed.launch), or train without fsdp."
        )
    if optimizer is not None:
        raise ValueError(
            "fully_shard replaces the model's parameters, so an optimizer built before it updates nothing "
            "FSDP uses: call course_lib.training.fsdp.shard_model(model) first, then build the optimizer."
        )
    for block in transformer_blocks(model):  # one all-gather per block: only one block whole at a time
        # reshard_after_forward=True: free the gathered parameters after forward, gather again in backward
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)  # the rest: embeddings, head
    return model


def require_sharded(model: torch.nn.Module, enabled: bool, accelerator=None) -> None:
    """Refuse an optimizer made before sharding: with ``enabled``, ``model`` must be sharded already
    (by ``training.build_optimizer``, which shards and then builds) or by the ``accelerator``."""
    if enabled and not is_sharded(model) and not accelerator_shards(accelerator):
        raise ValueError(
            "fsdp with an optimizer passed in: fully_shard replaces the model's parameters, so the optimizer "
            "must be built after it. Build both with course_lib.training.build_optimizer(model, config), "
            "or pass no optimizer."
        )


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards under FSDP, everything otherwise)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def full_state(model: torch.nn.Module, optimizer=None) -> tuple[dict, dict]:
    """The full model and optimizer state dicts on rank 0's CPU (empty on the other ranks); without
    an ``optimizer`` the second is empty. A collective: every rank calls it. The optimizer's state is
    keyed by parameter name (FQN), as are its param groups' ``params``.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, optimizer, options=options)


def load_full_state(model: torch.nn.Module, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load full state dicts (every rank passes the same ones) into the sharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
        # keys a scheduler added (initial_lr): set_state_dict loads only keys the groups already have
        group.update({k: v for k, v in saved.items() if k != "params" and k not in group})
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
    )
