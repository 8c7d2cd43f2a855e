"""Horovod's reducescatter and grouped reducescatter, with their ``_async`` forms.

The tensors (same shape and dtype on every rank) are reduced across the process set and split
along dimension 0: set rank r keeps ``d0 // n`` rows, one more if ``r < d0 % n`` (Horovod's
split). All tensors of one dtype travel in one ``reduce_scatter``: each rank's rows of every
tensor are laid out together in one flat segment per rank, padded to the longest segment.
The out-of-place forms are differentiable (Horovod's gradient: the output gradients all-gathered,
times the set size for ``Sum``, times the scaling factors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_tensor
from phalanx.comm import collectives as c
from phalanx.horovod import dtypes
from phalanx.horovod.allreduce import _TORCH_OP, finish_scale, resolve_op, scale_
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.grouped import check_tensors
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind, ReduceOp
from phalanx.horovod.requests import Agreement, Request

__all__ = [
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "rows_of",
]


def rows_of(d0: int, n: int) -> list[int]:
    """Rows each set rank keeps of a dimension of size ``d0`` (Horovod's split)."""
    return [d0 // n + (r < d0 % n) for r in range(n)]


def _segments(tensors: list[torch.Tensor], n: int) -> tuple[torch.Tensor, list[list[int]]]:
    """One flat buffer of n equal segments: segment r holds rank r's rows of every tensor."""
    rows = [rows_of(t.shape[0], n) for t in tensors]
    pieces = [[p.reshape(-1) for p in t.split(r)] for t, r in zip(tensors, rows)]
    lengths = [sum(ps[r].numel() for ps in pieces) for r in range(n)]
    width = max(lengths)
    flat = tensors[0].new_zeros(n * width)
    for r in range(n):
        if lengths[r]:
            flat[r * width : r * width + lengths[r]] = torch.cat([ps[r] for ps in pieces])
    return flat, rows


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    group, me = req.options["group"], req.options["me"]
    n, op = dist.get_world_size(group), ReduceOp(req.op)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(req.tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    works, outputs = [], []
    for dtype, idx in by_dtype.items():
        wide = [req.tensors[i].detach().to(dtypes.wire_dtype(dtype)) for i in idx]
        flat, rows = _segments(wide, n)
        scale_(flat, req.pre)
        out = flat.new_empty(flat.numel() // n)
        works.append(c.reduce_scatter_tensor(out, flat, _TORCH_OP[op], group, async_op=True))
        outputs.append((idx, rows, out, dtype))

    def result() -> Any:
        got: list[torch.Tensor] = [torch.empty(0)] * len(req.tensors)
        for idx, rows, out, dtype in outputs:
            finish_scale(out, op, req.post, n)
            offset = 0
            for i, r in zip(idx, rows):
                shape = (r[me], *req.tensors[i].shape[1:])
                size = torch.Size(shape).numel()
                got[i] = dtypes.narrow(out[offset : offset + size].view(shape), dtype)
                offset += size
        return got[0] if req.kind == Kind.REDUCESCATTER else got

    return works, result


def _submit(
    tensors: list[torch.Tensor],
    op: ReduceOp,
    pre: float,
    post: float,
    ps: ProcessSet,
    name: str | None,
    blocking: bool,
    kind: Kind,
) -> Handle:
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(
            f"{kind.label} needs tensors with at least one dimension (it splits "
            f"dimension 0 across the ranks), got a scalar"
        )
    req = Request(
        kind,
        name,
        tensors,
        _start,
        op=int(op),
        pre=pre,
        post=post,
        options={"group": ps.group, "me": ps.rank()},
    )
    return controller(ps).submit(req, blocking)


def _scaled_gradients(grads: Sequence[torch.Tensor], ctx: Any) -> list[torch.Tensor]:
    factor = (len(ctx.ps.ranks) if ctx.op == ReduceOp.Sum else 1) * ctx.pre * ctx.post
    return [g * factor if factor != 1 else g for g in grads]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        pre: float,
        post: float,
        ps: ProcessSet,
        name: str | None,
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return _submit([tensor], op, pre, post, ps, name, True, Kind.REDUCESCATTER).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from phalanx.horovod.allgather import allgather

        return allgather(_scaled_gradients([grad], ctx)[0], process_set=ctx.ps), *[None] * 5


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        op: ReduceOp,
        pre: float,
        post: float,
        ps: ProcessSet,
        name: str | None,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        kind = Kind.GROUPED_REDUCESCATTER
        return tuple(_submit(list(tensors), op, pre, post, ps, name, True, kind).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        from phalanx.horovod.allgather import grouped_allgather

        gathered = grouped_allgather(_scaled_gradients(grads, ctx), process_set=ctx.ps)
        return None, None, None, None, None, *gathered


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing ``tensor`` across the set and keeping this rank's rows of the result."""
    op, ps = resolve_op(op), resolve(process_set)
    return _submit(
        [tensor], op, prescale_factor, postscale_factor, ps, name, False, Kind.REDUCESCATTER
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` across the set; return this rank's rows of the result.

    Args:
        tensor: Same shape and dtype on every rank, at least one dimension.
        name: Matches this operation across ranks (unnamed ones match by call order).
        compression: Applied on the wire (e.g. ``hvd.Compression.fp16``).
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        process_set: An ``hvd.ProcessSet``; None for all ranks.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after the reduction.

    Returns:
        Rows ``[start_r, start_r + rows_r)`` of the reduced tensor (see :func:`rows_of`).
    """
    check_tensor("tensor", tensor, where="hvd.reducescatter")
    op, ps = resolve_op(op), resolve(process_set)
    check_compression(compression)
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = _Reducescatter.apply(wire, op, prescale_factor, postscale_factor, ps, name)
    else:
        out = _submit(
            [wire], op, prescale_factor, postscale_factor, ps, name, True, Kind.REDUCESCATTER
        ).wait()
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start a reducescatter of each of ``tensors`` (one negotiation, one collective per dtype)."""
    op, ps = resolve_op(op), resolve(process_set)
    return _submit(
        check_tensors(tensors),
        op,
        prescale_factor,
        postscale_factor,
        ps,
        name,
        False,
        Kind.GROUPED_REDUCESCATTER,
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each of ``tensors``; returns this rank's rows of each (differentiable)."""
    op, ps = resolve_op(op), resolve(process_set)
    tensors = check_tensors(tensors)
    check_compression(compression)
    packed = [compression.compress(t) for t in tensors]
    wires = [w for w, _ in packed]
    if torch.is_grad_enabled() and any(w.requires_grad for w in wires):
        outs = list(
            _GroupedReducescatter.apply(op, prescale_factor, postscale_factor, ps, name, *wires)
        )
    else:
        outs = _submit(
            wires, op, prescale_factor, postscale_factor, ps, name, True, Kind.GROUPED_REDUCESCATTER
        ).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]
