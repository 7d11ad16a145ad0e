"""How far data-parallel replicas are apart, and a loss averaged over every rank's share of the rows.

Both gather with ``torch.distributed.all_gather`` in its list form, which ``instruments.comm`` does not
count: a measurement never shows up as the training traffic it measures. Call them on every rank of a
launched process group, at the same point of the loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.distributed import flat_params, rank_device


def replica_drift(model: torch.nn.Module, anchor: torch.Tensor) -> dict[str, float]:
    """How far the replicas are apart, and how their moves since ``anchor`` (the last average) compare.

    ``distance``: largest L2 distance between rank 0's flattened parameters and another rank's (0: in
    sync); ``moved``: rank 0's L2 distance from ``anchor``; ``cosine``: between rank 0's and the last
    rank's moves since ``anchor`` (1: the same direction, 0: unrelated; 0 when nothing moved).
    """
    device = rank_device(dist.get_rank())
    mine, anchor = flat_params(model).to(device), anchor.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # the list form, which instruments.comm does not count
    moves = [g - anchor for g in gathered]
    # moves[-1]: rank 1 of two
    cosine = torch.nn.functional.cosine_similarity(moves[0], moves[-1], dim=0).item()
    return {
        "distance": max((g - gathered[0]).norm().item() for g in gathered),
        "moved": moves[0].norm().item(),
        "cosine": cosine,
    }


@torch.no_grad()
def mean_loss_over_ranks(model: torch.nn.Module, batch: dict) -> float:
    """Mean loss of ``model`` in eval mode over all ranks' rows (each rank passes its own ``batch``)."""
    model.eval()
    n = batch["labels"].numel()
    # sum and count: ranks with unequal shares still average right
    mine = torch.tensor(
        [model(**batch).loss.item() * n, n], dtype=torch.float64, device=batch["labels"].device
    )
    model.train()
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # the list form, which instruments.comm does not count
    total = torch.stack(gathered).sum(dim=0)
    return (total[0] / total[1]).item()
