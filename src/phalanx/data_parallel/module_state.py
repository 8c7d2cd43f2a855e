"""Replicas that start equal: check the model matches across ranks, then broadcast its state.

Used when ``DistributedDataParallel`` is built (seed 002: "every process starts from rank 0's
parameters"), before forwards (module buffers) and when a ``join`` ends (the last joiner's
model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.objects import all_gather_object
from phalanx.data_parallel.coalesce import copy_back, flatten, group_by_kind

__all__ = ["ModelMismatchError", "broadcast_coalesced", "check_same_model", "common_rank"]


class ModelMismatchError(RuntimeError):
    """The ranks hold different models (torch raises ``RuntimeError`` here too)."""


def broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None
) -> None:
    """Broadcast many tensors from global rank ``src`` as one flat tensor per (device, dtype)."""
    for indices in group_by_kind(tensors):
        same = [tensors[i] for i in indices]
        flat = flatten(same)
        c.broadcast(flat, src, group)
        copy_back(flat, same)


def common_rank(candidate: bool, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The highest global rank among those passing ``candidate=True`` (-1 if none): one
    all-reduce, the same one torch's DDP issues, so joined and training ranks stay matched."""
    rank = torch.tensor([dist.get_rank() if candidate else -1], device=device)
    c.all_reduce(rank, dist.ReduceOp.MAX, group)
    return int(rank.item())


def check_same_model(
    named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> None:
    """Every rank must hold the same parameter names, shapes and dtypes; name what differs.

    Raises:
        ModelMismatchError: on every rank, naming the first differing rank, the parameter and
            both shapes.
    """
    mine = [[n, list(p.shape), str(p.dtype)] for n, p in named]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    all_gather_object(everyone, mine, group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs != reference:
            raise ModelMismatchError(_difference(reference, theirs, rank, dist.get_rank()))


def _difference(ref: list[Any], other: list[Any], rank: int, me: int) -> str:
    head = f"[rank {me}] DistributedDataParallel: the model on rank {rank} differs from rank 0's"
    ref_by = {n: (s, d) for n, s, d in ref}
    other_by = {n: (s, d) for n, s, d in other}
    for name, (shape, dtype) in ref_by.items():
        if name not in other_by:
            return f"{head}: parameter {name!r} (shape {shape}) is missing on rank {rank}"
        oshape, odtype = other_by[name]
        if oshape != shape or odtype != dtype:
            return (
                f"{head}: parameter {name!r} has shape {shape} {dtype} on rank 0 but "
                f"{oshape} {odtype} on rank {rank}"
            )
    extra = [n for n in other_by if n not in ref_by]
    if extra:
        return f"{head}: rank {rank} has extra parameter(s) {extra}"
    return f"{head}: the parameters are registered in a different order"
