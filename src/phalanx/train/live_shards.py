"""A live job's data shards, and the exact reduction that makes a run membership-independent.

A step's global batch is split into *shards* (``StepPlan`` over the shard count) and each member
trains the shards it owns, one micro-step each (``LiveTraining.deal`` deals their indices):

* **plain** (``recovery="live"``): one shard per member, reduced by DDP's bucketed all-reduce
  during backward. After a change of membership the average is over another number of terms, so
  the parameters drift from a fault-free run by floating-point reassociation only.
* **exact** (``recovery="live-exact"``): as many shards as the launcher started members, always;
  a smaller membership trains several per member. Each shard's gradient is kept apart, and
  :func:`exact_average` sums them in shard order on every member (an all-gather of the members'
  shard gradients, then ``g_0 + g_1 + ... + g_{V-1}``, divided by ``V``): the same operations in
  the same order whoever computed which shard, so a run that lost and regained members ends
  bit-identical to a fault-free one. The price: no overlap with backward, and ``world_size``
  times the bytes of an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.data.elastic_plan import split_counts

__all__ = [
    "ShardGrads",
    "exact_average",
    "flat_grads",
    "owned_shards",
    "set_grads",
]


def owned_shards(shards: int, world_size: int, rank: int) -> list[int]:
    """The shards ``rank`` trains: contiguous, the first ``shards % world_size`` ranks one more."""
    counts = split_counts(shards, world_size)
    first = sum(counts[:rank])
    return list(range(first, first + counts[rank]))


def flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients as one flat copy (zeros for a parameter without one)."""
    parts = [
        torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        if p.grad is None
        else p.grad.detach().reshape(-1)
        for p in params
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def set_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Make each parameter's gradient its slice of ``flat``."""
    offset = 0
    for p in params:
        part = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.detach().copy_(part)
        offset += p.numel()


def exact_average(slots: Sequence[torch.Tensor], shards: int, world_size: int) -> torch.Tensor:
    """The mean of every shard's gradient, summed in shard order; collective.

    Args:
        slots: This member's shard gradients (flat, equal sizes), in the order of its shards.
        shards: The shard count ``V``.
        world_size: Members of the current group; member ``r`` holds
            ``owned_shards(shards, world_size, r)``.
    """
    counts = split_counts(shards, world_size)
    widest, size = max(counts), slots[0].numel()
    mine = torch.zeros(widest, size, dtype=slots[0].dtype, device=slots[0].device)
    for i, g in enumerate(slots):
        mine[i].copy_(g)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    ordered = [gathered[r][i] for r in range(world_size) for i in range(counts[r])]
    total = ordered[0].clone()
    for g in ordered[1:]:
        total.add_(g)
    return total.div_(shards)


class ShardGrads:
    """Exact mode's gradients of this step's shards so far, one flat tensor per shard."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []

    def stash(self, params: list[torch.Tensor]) -> None:
        """Keep the gradients of the shard just trained; clear them from ``params``."""
        self.slots.append(flat_grads(params))
        for p in params:
            p.grad = None

    def reduce(self, params: list[torch.Tensor], shards: int, world_size: int) -> None:
        """Every member's shards summed in shard order into ``params``' gradients (collective;
        the slots are emptied first, so a failure leaves none behind)."""
        slots, self.slots = self.slots, []
        set_grads(params, exact_average(slots, shards, world_size))

    def clear(self) -> None:
        """Drop the stashed gradients (a failed step, a new generation)."""
        self.slots = []
