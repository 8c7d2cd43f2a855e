"""Horovod's allgather and broadcast, with their ``_async`` forms.

``allgather`` concatenates along dimension 0 and, as in Horovod, the first dimension may differ
from rank to rank: the shapes are exchanged first (one small all-gather), checked (an error names
every rank's shape), and the tensors padded to the longest. The out-of-place forms are
differentiable, with Horovod's gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.horovod.allreduce import ReduceOp, reduce_async
from phalanx.horovod.basics import ProcessSet, check_group
from phalanx.horovod.handle import Handle
from phalanx.horovod.shapes import MAX_DIMS, describe, shape_row

__all__ = [
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
]


# ---- allgather ----------------------------------------------------------------------------------
def _gather_rows(x: torch.Tensor, group: ProcessSet) -> list[list[int]]:
    n = dist.get_world_size(group)
    rows = torch.empty(n * (2 + MAX_DIMS), dtype=torch.int64, device=x.device)
    c.all_gather_into_tensor(rows, shape_row(x), group)
    return rows.view(n, -1).tolist()


def _check_gatherable(rows: list[list[int]], group: ProcessSet) -> None:
    # Every rank compares the same rows, so every rank raises the same error (no hang).
    ref = rows[0]
    if all(r[0] == ref[0] and r[1] == ref[1] and r[3:] == ref[3:] for r in rows):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(rows))
    shapes = ", ".join(f"rank {g} has {describe(r)}" for g, r in zip(ranks, rows))
    raise ValueError(
        f"[rank {dist.get_rank()}] allgather: tensors must have the same dtype and the same "
        f"size in every dimension but the first; {shapes}"
    )


def _allgather_async(tensor: torch.Tensor, group: ProcessSet) -> tuple[Handle, list[int]]:
    x = tensor.detach()
    x = x.reshape(1) if x.dim() == 0 else x.contiguous()
    rows = _gather_rows(x, group)
    _check_gatherable(rows, group)
    firsts = [r[2] for r in rows]
    width = max(firsts)
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((len(rows) * width, *x.shape[1:]))
    work = c.all_gather_into_tensor(out, x, group, async_op=True)

    def result() -> torch.Tensor:
        if all(f == width for f in firsts):
            return out
        return torch.cat([out[i * width : i * width + f] for i, f in enumerate(firsts)])

    return Handle([work], result), firsts


class _Allgather(torch.autograd.Function):
    """Horovod's gradient: the averaged gradient's slice that this rank contributed."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessSet) -> torch.Tensor:
        handle, firsts = _allgather_async(tensor, group)
        me = dist.get_rank(group)
        ctx.group, ctx.offset, ctx.shape = group, sum(firsts[:me]), tensor.shape
        return handle.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = reduce_async(grad, ReduceOp.Average, 1.0, 1.0, ctx.group, False).wait()
        rows = ctx.shape[0] if len(ctx.shape) else 1
        return reduced.narrow(0, ctx.offset, rows).reshape(ctx.shape), None


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = None
) -> Handle:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0.

    The first dimension may differ across ranks; the others and the dtype must match.
    """
    return _allgather_async(tensor, check_group(process_set))[0]


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = None
) -> torch.Tensor:
    """Gather ``tensor`` from every rank, concatenated along dimension 0 (differentiable).

    Args:
        tensor: This rank's piece; its first dimension may differ from the other ranks'.
        name: Accepted for compatibility; operations are matched by call order.
        process_set: Group to gather over; None for all ranks.

    Returns:
        A new tensor whose first dimension is the sum of every rank's first dimension.
    """
    group = check_group(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, group)
    return _allgather_async(tensor, group)[0].wait()


# ---- broadcast ----------------------------------------------------------------------------------
def _broadcast_async(
    tensor: torch.Tensor, root_rank: int, group: ProcessSet, inplace: bool
) -> Handle:
    target = tensor.detach()
    copy_back = inplace and not target.is_contiguous()
    if inplace and not copy_back:
        buf = target
    else:
        buf = target.clone(memory_format=torch.contiguous_format)
    work = c.broadcast(buf, root_rank, group, async_op=True)

    def result() -> torch.Tensor:
        if copy_back:
            target.copy_(buf)
        return tensor if inplace else buf

    return Handle([work], result)


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient: the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, group: ProcessSet) -> Any:
        ctx.root, ctx.group = root_rank, group
        return _broadcast_async(tensor, root_rank, group, inplace=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = reduce_async(grad, ReduceOp.Average, 1.0, 1.0, ctx.group, False).wait()
        if dist.get_rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start broadcasting a copy of global rank ``root_rank``'s ``tensor``."""
    return _broadcast_async(tensor, root_rank, check_group(process_set, root_rank), False)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start overwriting ``tensor`` with global rank ``root_rank``'s, in place."""
    return _broadcast_async(tensor, root_rank, check_group(process_set, root_rank), True)


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet = None,
) -> torch.Tensor:  # fmt: skip
    """Return a new tensor holding global rank ``root_rank``'s ``tensor`` (differentiable)."""
    group = check_group(process_set, root_rank)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, group)
    return _broadcast_async(tensor, root_rank, group, inplace=False).wait()


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None,
    process_set: ProcessSet = None,
) -> torch.Tensor:  # fmt: skip
    """Overwrite ``tensor`` in place with global rank ``root_rank``'s; return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()
