"""Horovod's allgather and grouped allgather, with their ``_async`` forms.

The result is every rank's tensor concatenated along dimension 0, whose size may differ from
rank to rank (the others and the dtype must match: every rank raises otherwise). The first
dimensions travel in the negotiation round, so the gather itself is one collective per tensor:
pieces are padded to the longest and the padding dropped. The out-of-place forms are
differentiable, with Horovod's gradient: the slice this rank contributed of the averaged gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_tensor
from phalanx.comm import collectives as c
from phalanx.horovod import dtypes
from phalanx.horovod.grouped import check_tensors, submit_grouped
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind, ReduceOp
from phalanx.horovod.requests import Agreement, Request

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async"]


def _gather_one(
    x: torch.Tensor, firsts: list[int], group: Any
) -> tuple[Any, Callable[[], torch.Tensor]]:
    dtype = x.dtype
    x = x.detach().to(dtypes.wire_dtype(dtype), memory_format=torch.contiguous_format)
    width = max(firsts)
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((len(firsts) * width, *x.shape[1:]))
    work = c.all_gather_into_tensor(out, x, group, async_op=True)

    def result() -> torch.Tensor:
        if any(f != width for f in firsts):
            return dtypes.narrow(
                torch.cat([out[i * width : i * width + f] for i, f in enumerate(firsts)]), dtype
            )
        return dtypes.narrow(out, dtype)

    return work, result


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    works, parts = [], []
    for k, t in enumerate(req.tensors):
        firsts = [p[k] for p in agreement.payloads if p is not None]
        work, part = _gather_one(t, firsts, req.options["group"])
        works.append(work)
        parts.append(part)
    if req.kind == Kind.ALLGATHER:
        return works, parts[0]
    return works, lambda: [part() for part in parts]


def _submit(
    tensors: list[torch.Tensor],
    ps: ProcessSet,
    name: str | None,
    blocking: bool,
    kind: Kind = Kind.ALLGATHER,
) -> Handle:
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]  # scalars gather to a vector
    req = Request(
        kind,
        name,
        tensors,
        _start,
        payload=tuple(t.shape[0] for t in tensors),
        free_first_dim=True,
        options={"group": ps.group},
    )
    return controller(ps).submit(req, blocking)


def _slices(grads: Sequence[torch.Tensor], shapes: list[torch.Size], ps: ProcessSet) -> list[Any]:
    """Horovod's gradient: average the output gradients, keep this rank's rows of each."""
    firsts = [s[0] if len(s) else 1 for s in shapes]
    everyone = _submit([torch.tensor(firsts)], ps, None, True).wait().view(-1, len(firsts))
    me = ps.ranks.index(dist.get_rank())
    offsets = everyone[:me].sum(0).tolist()
    reduced = submit_grouped(list(grads), ReduceOp.Average, 1.0, 1.0, ps, False).wait()
    return [r.narrow(0, o, f).reshape(s) for r, o, f, s in zip(reduced, offsets, firsts, shapes)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, ps: ProcessSet, name: str | None) -> Any:
        ctx.ps, ctx.shape = ps, tensor.shape
        return _submit([tensor], ps, name, True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _slices([grad], [ctx.shape], ctx.ps)[0], None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ps: ProcessSet, name: str | None, *tensors: torch.Tensor) -> Any:
        ctx.ps, ctx.shapes = ps, [t.shape for t in tensors]
        return tuple(_submit(list(tensors), ps, name, True, Kind.GROUPED_ALLGATHER).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return None, None, *_slices(grads, ctx.shapes, ctx.ps)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> Handle:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0.

    The first dimension may differ across ranks; the others and the dtype must match.
    """
    return _submit([tensor], resolve(process_set), name, False)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Gather ``tensor`` from every rank, concatenated along dimension 0 (differentiable).

    Args:
        tensor: This rank's piece; its first dimension may differ from the other ranks'.
        name: Matches this operation across ranks (unnamed ones match by call order).
        process_set: An ``hvd.ProcessSet`` to gather over; None for all ranks.

    Returns:
        A new tensor whose first dimension is the sum of every rank's first dimension.
    """
    check_tensor("tensor", tensor, where="hvd.allgather")
    ps = resolve(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, ps, name)
    return _submit([tensor], ps, name, True).wait()


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None
) -> Handle:
    """Start gathering each of ``tensors`` from every rank (one negotiation for the list)."""
    ps = resolve(process_set)
    return _submit(check_tensors(tensors), ps, name, False, Kind.GROUPED_ALLGATHER)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    """Gather each of ``tensors`` from every rank, concatenated along dimension 0.

    Returns:
        One gathered tensor per input, in order. Differentiable, like :func:`allgather`.
    """
    ps, tensors = resolve(process_set), check_tensors(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_GroupedAllgather.apply(ps, name, *tensors))
    return _submit(tensors, ps, name, True, Kind.GROUPED_ALLGATHER).wait()
