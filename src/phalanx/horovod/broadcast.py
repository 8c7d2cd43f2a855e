"""Horovod's broadcast, ``broadcast_`` and their ``_async`` forms.

The root is a global rank and must be the same on every rank, as must the shape and dtype:
every rank raises otherwise. ``broadcast`` is differentiable with Horovod's gradient (the
averaged gradient on the root, zero elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_tensor
from phalanx.comm import collectives as c
from phalanx.horovod import dtypes
from phalanx.horovod.allreduce import submit_allreduce
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind, ReduceOp
from phalanx.horovod.requests import Agreement, Request

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"]


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    (tensor,) = req.tensors
    buf = dtypes.wire_buffer(tensor, req.options["inplace"])
    work = c.broadcast(buf, req.root, req.options["group"], async_op=True)

    def result() -> torch.Tensor:
        return dtypes.land(buf, tensor, req.options["inplace"])

    return [work], result


def _submit(
    tensor: torch.Tensor,
    root: int,
    ps: ProcessSet,
    inplace: bool,
    name: str | None,
    blocking: bool,
) -> Handle:
    req = Request(
        Kind.BROADCAST,
        name,
        [tensor],
        _start,
        root=root,
        options={"group": ps.group, "inplace": inplace},
    )
    return controller(ps).submit(req, blocking)


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient: the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, ps: ProcessSet, name: str | None) -> Any:
        ctx.root, ctx.ps = root, ps
        return _submit(tensor, root, ps, False, name, True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = submit_allreduce(grad, ReduceOp.Average, 1.0, 1.0, ctx.ps, False).wait()
        if dist.get_rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = None,
) -> Handle:
    """Start broadcasting a copy of global rank ``root_rank``'s ``tensor``."""
    return _submit(tensor, root_rank, resolve(process_set, root_rank), False, name, False)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = None,
) -> Handle:
    """Start overwriting ``tensor`` with global rank ``root_rank``'s, in place."""
    return _submit(tensor, root_rank, resolve(process_set, root_rank), True, name, False)


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = None,
) -> torch.Tensor:
    """Return a new tensor holding global rank ``root_rank``'s ``tensor`` (differentiable).

    Args:
        tensor: This rank's tensor (the root's is sent); same shape and dtype everywhere.
        root_rank: Global rank to copy from; the same on every rank.
        name: Matches this operation across ranks (unnamed ones match by call order).
        process_set: An ``hvd.ProcessSet`` containing ``root_rank``; None for all ranks.
    """
    check_tensor("tensor", tensor, where="hvd.broadcast")
    ps = resolve(process_set, root_rank)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, ps, name)
    return _submit(tensor, root_rank, ps, False, name, True).wait()


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = None,
) -> torch.Tensor:
    """Overwrite ``tensor`` in place with global rank ``root_rank``'s; return it."""
    return _submit(tensor, root_rank, resolve(process_set, root_rank), True, name, True).wait()
