"""Horovod's all-reduce: ``allreduce``, ``allreduce_`` and their ``_async`` forms.

Semantics follow ``horovod.torch``: the result is ``postscale * reduce(prescale * x)``, divided
by the process-set size for ``Average``; integer tensors are scaled in float64 and truncated
toward zero, as Horovod's C++ core does. ``allreduce`` returns a new tensor and is
differentiable (the gradient is all-reduced with the same operation); ``allreduce_`` works in
place. A rank in ``join()`` contributes the operation's neutral value (0 for a sum or average,
1 for a product, the dtype's extreme for min and max); the average still divides by the whole
set, as in Horovod.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_bool, check_tensor
from phalanx.comm import collectives as c
from phalanx.horovod import dtypes
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.controller import NEUTRAL
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind, ReduceOp
from phalanx.horovod.requests import Agreement, Request

__all__ = [
    "ReduceOp",
    "UnsupportedOpError",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "launch",
    "neutral_tensor",
    "resolve_op",
    "submit_allreduce",
]

_TORCH_OP = {
    ReduceOp.Average: dist.ReduceOp.SUM,  # then divided by the group size
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


class UnsupportedOpError(ValueError, RuntimeError):
    """An ``op`` Horovod defines that phalanx does not implement (Adasum).

    A ``ValueError`` like every other bad argument here, and a ``RuntimeError`` like Horovod's
    own refusal (its test ``test_horovod_reducescatter_adasum`` expects one).
    """


def resolve_op(op: Any, average: bool | None = None) -> ReduceOp:
    """Turn ``op`` / the deprecated ``average`` flag into a supported :class:`ReduceOp`."""
    if op is not None and average is not None:
        raise ValueError(
            f"pass op= or the deprecated average=, not both (got op={op!r}, "
            f"average={average!r}); op supersedes average"
        )
    if average is not None:
        check_bool("average", average, where="hvd", fix="or None; better op=hvd.Average")
        warnings.warn(
            "average= is deprecated; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    if op == ReduceOp.Adasum:
        raise UnsupportedOpError("op=Adasum: Adasum is not supported, use Average or Sum")
    try:
        return ReduceOp(op)
    except (ValueError, TypeError):
        raise ValueError(
            f"op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product"
        ) from None


def scale_(t: torch.Tensor, factor: float) -> None:
    """Multiply in place; integers go through float64 and truncate toward zero (Horovod's)."""
    if factor == 1:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).to(t.dtype))


def finish_scale(t: torch.Tensor, op: ReduceOp, post: float, n: int) -> None:
    """Apply the postscale factor (and the 1/n of an average) to a reduced tensor."""
    if op != ReduceOp.Average:
        scale_(t, post)
    elif post != 1:
        scale_(t, post / n)
    elif t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def launch(
    buffers: list[torch.Tensor],
    op: ReduceOp,
    pre: float,
    post: float,
    group: Any,
) -> tuple[list[Any], Callable[[], None]]:
    """Scale and start reducing ``buffers`` in place; returns the works and the finishing step."""
    n = dist.get_world_size(group)
    works = []
    for buf in buffers:
        scale_(buf, pre)
        works.append(c.all_reduce(buf, _TORCH_OP[op], group, async_op=True))

    def finish() -> None:
        for buf in buffers:
            finish_scale(buf, op, post, n)

    return works, finish


def neutral_tensor(shape: Sequence[int], dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """What a joined rank contributes: the identity of ``op`` (0, 1 or the dtype's extreme)."""
    if op in (ReduceOp.Sum, ReduceOp.Average):
        return torch.zeros(shape, dtype=dtype)
    if op == ReduceOp.Product:
        return torch.ones(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.full(shape, op == ReduceOp.Min, dtype=dtype)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    extreme = info.max if op == ReduceOp.Min else info.min
    if dtype.is_floating_point:
        extreme = float("inf") if op == ReduceOp.Min else float("-inf")
    return torch.full(shape, extreme, dtype=dtype)


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    (tensor,) = req.tensors
    buf = dtypes.wire_buffer(tensor, req.options["inplace"])
    works, finish = launch([buf], ReduceOp(req.op), req.pre, req.post, req.options["group"])

    def result() -> torch.Tensor:
        finish()
        return dtypes.land(buf, tensor, req.options["inplace"])

    return works, result


def _neutral(desc: dict[str, Any]) -> Request:
    (dtype, shape, _), op = desc["tensors"][0], ReduceOp(desc["op"])
    t = neutral_tensor(shape, getattr(torch, dtype), op)
    return Request(
        Kind.ALLREDUCE, None, [t], _start, op=int(op), options={"group": None, "inplace": True}
    )


NEUTRAL[Kind.ALLREDUCE] = _neutral


def submit_allreduce(
    tensor: torch.Tensor,
    op: ReduceOp,
    pre: float,
    post: float,
    ps: ProcessSet,
    inplace: bool,
    name: str | None = None,
    blocking: bool = True,
) -> Handle:
    """Negotiate and start one all-reduce with resolved arguments."""
    req = Request(
        Kind.ALLREDUCE,
        name,
        [tensor],
        _start,
        op=int(op),
        pre=pre,
        post=post,
        options={"group": ps.group, "inplace": inplace},
    )
    return controller(ps).submit(req, blocking)


class _Allreduce(torch.autograd.Function):
    """Differentiable all-reduce: the gradient is all-reduced with the same operation."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        pre: float,
        post: float,
        ps: ProcessSet,
        name: str | None,
    ) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return submit_allreduce(tensor, op, pre, post, ps, False, name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        reduced = submit_allreduce(grad, op, pre, post, ps, False).wait()
        return reduced, None, None, None, None, None


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start reducing a copy of ``tensor``; ``synchronize(handle)`` returns the new tensor.

    Args:
        tensor: The tensor to reduce (left unchanged).
        average: Deprecated; use ``op``.
        name: Matches this operation across ranks (unnamed ones match by call order); a name
            still in flight on this rank raises ValueError.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after the reduction.
        process_set: An ``hvd.ProcessSet`` to reduce over; None for all ranks.

    Returns:
        A :class:`Handle` for :func:`synchronize` / :func:`poll`.
    """
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_allreduce(tensor, op, prescale_factor, postscale_factor, ps, False, name, False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``."""
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_allreduce(tensor, op, prescale_factor, postscale_factor, ps, True, name, False)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and return the result as a new tensor.

    Same arguments as :func:`allreduce_async`, plus ``compression`` (e.g.
    ``hvd.Compression.fp16``) applied on the wire. Differentiable.
    """
    check_tensor("tensor", tensor, where="hvd.allreduce")
    op, ps = resolve_op(op, average), resolve(process_set)
    check_compression(compression)
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = _Allreduce.apply(wire, op, prescale_factor, postscale_factor, ps, name)
    else:
        out = submit_allreduce(wire, op, prescale_factor, postscale_factor, ps, False, name).wait()
    return compression.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_allreduce(tensor, op, prescale_factor, postscale_factor, ps, True, name).wait()
