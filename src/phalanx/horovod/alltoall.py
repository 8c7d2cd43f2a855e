"""Horovod's ``alltoall``: send ``splits[j]`` rows to rank j, receive every rank's rows.

The splits and trailing shapes are exchanged first (one small all-to-all), so the receive
buffer has the right size and a rank whose tensor does not fit is named in an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.horovod.basics import ProcessSet, check_group
from phalanx.horovod.handle import Handle
from phalanx.horovod.shapes import describe, shape_row

__all__ = ["alltoall", "alltoall_async"]


def _send_splits(splits: Any, x: torch.Tensor, n: int) -> list[int]:
    if splits is None:
        if x.shape[0] % n:
            raise ValueError(f"alltoall without splits divides dimension 0 evenly by the "
                             f"{n} ranks, but it has size {x.shape[0]}; pass splits=")  # fmt: skip
        return [x.shape[0] // n] * n
    out = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(out) != n or any(s < 0 for s in out) or sum(out) != x.shape[0]:
        raise ValueError(f"splits={out} must hold {n} non-negative sizes (one per rank) summing "
                         f"to dimension 0 of the tensor, {x.shape[0]}")  # fmt: skip
    return out


def _exchange_splits(x: torch.Tensor, send: list[int], group: ProcessSet) -> list[int]:
    n = len(send)
    mine = shape_row(x).repeat(n, 1)
    mine[:, 2] = torch.tensor(send)  # the size sent to rank j replaces dimension 0 in row j
    theirs = torch.empty_like(mine)
    c.all_to_all_single(theirs, mine, group=group)
    rows = theirs.tolist()
    me = mine[0].tolist()
    bad = [j for j, r in enumerate(rows) if r[:2] != me[:2] or r[3:] != me[3:]]
    if bad:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        others = ", ".join(f"rank {ranks[j]} sends {describe(rows[j], True)}" for j in bad)
        raise ValueError(
            f"[rank {dist.get_rank()}] alltoall: tensors must have the same dtype and the same "
            f"size in every dimension but the first; this rank has {describe(me, True)}, {others}"
        )
    return [r[2] for r in rows]


def _alltoall_async(tensor: torch.Tensor, splits: Any, group: ProcessSet) -> Handle:
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
    x = tensor.detach().contiguous()
    send = _send_splits(splits, x, dist.get_world_size(group))
    recv = _exchange_splits(x, send, group)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = c.all_to_all_single(out, x, recv, send, group, async_op=True)
    received = torch.tensor(recv, dtype=torch.int32)
    return Handle([work], lambda: (out, received))


class _Alltoall(torch.autograd.Function):
    """The gradient travels back: an alltoall with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, group: ProcessSet) -> Any:
        out, received = _alltoall_async(tensor, splits, group).wait()
        ctx.received, ctx.group = received, group
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        out, _received = _alltoall_async(grad, ctx.received, ctx.group).wait()
        return out, None, None


def alltoall_async(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None, process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    return _alltoall_async(tensor, splits, check_group(process_set))


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None, process_set: ProcessSet = None,
) -> Any:  # fmt: skip
    """Send ``splits[j]`` rows of ``tensor`` to rank j; concatenate what arrives, by rank.

    Args:
        tensor: Rows to distribute along dimension 0.
        splits: Rows for each rank, in rank order; None splits dimension 0 evenly.
        name: Accepted for compatibility.
        process_set: Group to exchange within; None for all ranks.

    Returns:
        The received tensor; when ``splits`` is given, ``(tensor, received_splits)`` with the
        rows received from each rank (int32), as Horovod returns.
    """
    group = check_group(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        out, received = _Alltoall.apply(tensor, splits, group)
    else:
        out, received = _alltoall_async(tensor, splits, group).wait()
    return out if splits is None else (out, received)
