"""Horovod's all-reduce family: ``allreduce``, ``allreduce_``, their ``_async`` forms, grouped.

Semantics follow ``horovod.torch``: the result is ``postscale * reduce(prescale * x)``, divided
by the process-set size for ``Average``; integer tensors are scaled in float64 and truncated
toward zero, as Horovod's C++ core does. ``allreduce`` returns a new tensor and is
differentiable (the gradient is all-reduced with the same operation); ``allreduce_`` works in
place.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.horovod.basics import ProcessSet, check_group
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.handle import Handle

__all__ = [
    "ReduceOp",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "resolve_op",
]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations (exported as ``hvd.Average``, ``hvd.Sum``, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


_TORCH_OP = {
    ReduceOp.Average: dist.ReduceOp.SUM,  # then divided by the group size
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


def resolve_op(op: Any, average: bool | None = None) -> ReduceOp:
    """Turn ``op`` / the deprecated ``average`` flag into a supported :class:`ReduceOp`."""
    if op is not None and average is not None:
        raise ValueError(f"pass op= or the deprecated average=, not both (got op={op!r}, "
                         f"average={average!r}); op supersedes average")  # fmt: skip
    if average is not None:
        warnings.warn("average= is deprecated; use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    if op == ReduceOp.Adasum:
        raise ValueError("Adasum is not supported, use Average or Sum")
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


def _finish_scale(t: torch.Tensor, op: ReduceOp, post: float, n: int) -> None:
    if op != ReduceOp.Average:
        scale_(t, post)
    elif post != 1:
        scale_(t, post / n)
    elif t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def launch(
    buffers: list[torch.Tensor], op: ReduceOp, pre: float, post: float, group: ProcessSet,
) -> tuple[list[Any], Callable[[], None]]:  # fmt: skip
    """Scale and start reducing ``buffers`` in place; returns the works and the finishing step."""
    n = dist.get_world_size(group)
    works = []
    for buf in buffers:
        scale_(buf, pre)
        works.append(c.all_reduce(buf, _TORCH_OP[op], group, async_op=True))

    def finish() -> None:
        for buf in buffers:
            _finish_scale(buf, op, post, n)

    return works, finish


def reduce_async(
    tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, group: ProcessSet,
    inplace: bool,
) -> Handle:  # fmt: skip
    """All-reduce ``tensor`` (in place, or a copy) with resolved arguments."""
    target = tensor.detach()
    copy_back = inplace and not target.is_contiguous()
    if inplace and not copy_back:
        buf = target
    else:
        buf = target.clone(memory_format=torch.contiguous_format)
    works, finish = launch([buf], op, pre, post, group)

    def result() -> torch.Tensor:
        finish()
        if copy_back:
            target.copy_(buf)
            return tensor
        return tensor if inplace else buf

    return Handle(works, result)


class _Allreduce(torch.autograd.Function):
    """Differentiable all-reduce: the gradient is all-reduced with the same operation."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float,
                group: ProcessSet) -> torch.Tensor:  # fmt: skip
        ctx.args = (op, pre, post, group)
        return reduce_async(tensor, op, pre, post, group, inplace=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, group = ctx.args
        reduced = reduce_async(grad, op, pre, post, group, inplace=False).wait()
        return reduced, None, None, None, None


def allreduce_async(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start reducing a copy of ``tensor``; ``synchronize(handle)`` returns the new tensor.

    Args:
        tensor: The tensor to reduce (left unchanged).
        average: Deprecated; use ``op``.
        name: Accepted for compatibility; operations are matched by call order, not name.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after the reduction.
        process_set: Group to reduce over; None for all ranks.

    Returns:
        A :class:`Handle` for :func:`synchronize` / :func:`poll`.
    """
    op = resolve_op(op, average)
    group = check_group(process_set)
    return reduce_async(tensor, op, prescale_factor, postscale_factor, group, inplace=False)


def allreduce_async_(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``."""
    op = resolve_op(op, average)
    group = check_group(process_set)
    return reduce_async(tensor, op, prescale_factor, postscale_factor, group, inplace=True)


def allreduce(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
    compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = None,
) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` over the ranks and return the result as a new tensor.

    Same arguments as :func:`allreduce_async`, plus ``compression`` (e.g.
    ``hvd.Compression.fp16``) applied on the wire. Differentiable.
    """
    op = resolve_op(op, average)
    group = check_group(process_set)
    check_compression(compression)
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = _Allreduce.apply(wire, op, prescale_factor, postscale_factor, group)
    else:
        out = reduce_async(wire, op, prescale_factor, postscale_factor, group, False).wait()
    return compression.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` in place and return it."""
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                              process_set)  # fmt: skip
    return handle.wait()
