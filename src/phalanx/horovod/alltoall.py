"""Horovod's ``alltoall``: send ``splits[j]`` rows to rank j, receive every rank's rows.

Each rank's splits travel in the negotiation round, so every rank knows how many rows it
receives from each peer before the exchange; the trailing dimensions and the dtype must match
(every rank raises otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx._check import check_tensor
from phalanx.comm import collectives as c
from phalanx.horovod import dtypes
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind
from phalanx.horovod.requests import Agreement, Request

__all__ = ["alltoall", "alltoall_async"]


def _send_splits(splits: Any, x: torch.Tensor, n: int) -> list[int]:
    if splits is None:
        if x.shape[0] % n:
            raise ValueError(
                f"alltoall without splits divides dimension 0 evenly by the "
                f"{n} ranks, but it has size {x.shape[0]}; pass splits="
            )
        return [x.shape[0] // n] * n
    if isinstance(splits, torch.Tensor) and (
        splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool
    ):
        raise ValueError(
            f"splits must hold integers (int32, as Horovod's), got a tensor of {splits.dtype}"
        )
    raw = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if any(not isinstance(s, int) or isinstance(s, bool) for s in raw):
        raise ValueError(f"splits must hold integers, got {raw}")
    if len(raw) != n or any(s < 0 for s in raw) or sum(raw) != x.shape[0]:
        raise ValueError(
            f"splits={raw} must hold {n} non-negative sizes (one per rank) summing "
            f"to dimension 0 of the tensor, {x.shape[0]}"
        )
    return raw


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    (tensor,) = req.tensors
    me = req.options["me"]
    recv = [p[me] for p in agreement.payloads if p is not None]
    x = tensor.detach().to(dtypes.wire_dtype(tensor.dtype), memory_format=torch.contiguous_format)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = c.all_to_all_single(out, x, recv, list(req.payload), req.options["group"], async_op=True)
    received = torch.tensor(recv, dtype=torch.int32, device=req.options["splits_device"])
    return [work], lambda: (dtypes.narrow(out, tensor.dtype), received)


def _submit(
    tensor: torch.Tensor, splits: Any, ps: ProcessSet, name: str | None, blocking: bool
) -> Handle:
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
    n = len(ps.ranks)
    send = _send_splits(splits, tensor, n)
    device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    options = {"group": ps.group, "me": ps.rank(), "splits_device": device}
    req = Request(
        Kind.ALLTOALL,
        name,
        [tensor],
        _start,
        payload=tuple(send),
        free_first_dim=True,
        options=options,
    )
    return controller(ps).submit(req, blocking)


class _Alltoall(torch.autograd.Function):
    """The gradient travels back: an alltoall with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, ps: ProcessSet, name: Any) -> Any:
        out, received = _submit(tensor, splits, ps, name, True).wait()
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        out, _received = _submit(grad, ctx.received, ctx.ps, None, True).wait()
        return out, None, None, None


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = None,
) -> Handle:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    return _submit(tensor, splits, resolve(process_set), name, False)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: Any = None,
) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j; concatenate what arrives, by rank.

    Args:
        tensor: Rows to distribute along dimension 0.
        splits: Rows for each rank of the set, in rank order (integers); None splits dimension 0
            evenly.
        name: Matches this operation across ranks (unnamed ones match by call order).
        process_set: An ``hvd.ProcessSet`` to exchange within; None for all ranks.

    Returns:
        The received tensor; when ``splits`` is given, ``(tensor, received_splits)`` with the
        rows received from each rank (int32), as Horovod returns.
    """
    check_tensor("tensor", tensor, where="hvd.alltoall")
    ps = resolve(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        out, received = _Alltoall.apply(tensor, splits, ps, name)
    else:
        out, received = _submit(tensor, splits, ps, name, True).wait()
    return out if splits is None else (out, received)
