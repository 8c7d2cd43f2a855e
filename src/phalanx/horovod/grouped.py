"""Horovod's grouped all-reduce: many tensors, one negotiation, one collective per dtype.

The tensors are packed into one flat buffer per (device, wire dtype), reduced together (one
launch latency instead of one per tensor) and unpacked into new tensors, or back in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx._check import check_instance, check_tensor, part_of
from phalanx.data_parallel.coalesce import flatten, group_by_kind
from phalanx.horovod import dtypes
from phalanx.horovod.allreduce import allreduce, launch, neutral_tensor, resolve_op
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.controller import NEUTRAL
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind, ReduceOp
from phalanx.horovod.requests import Agreement, Request

__all__ = [
    "check_tensors",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "pack",
    "submit_grouped",
]


def pack(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """``(indices, flat buffer)`` per (device, wire dtype): the tensors concatenated, widened."""
    kinds = group_by_kind(tensors, key=lambda t: (t.device, dtypes.wire_dtype(t.dtype)))
    return [
        (idx, flatten([tensors[i] for i in idx], dtypes.wire_dtype(tensors[idx[0]].dtype)))
        for idx in kinds
    ]


def unpack(
    tensors: Sequence[torch.Tensor], packed: list[tuple[list[int], torch.Tensor]], inplace: bool
) -> list[torch.Tensor]:
    """Pieces of the flat buffers, shaped like ``tensors`` (written back when ``inplace``)."""
    out: list[torch.Tensor] = list(tensors)
    for idx, flat in packed:
        offset = 0
        for i in idx:
            t = tensors[i]
            piece = dtypes.narrow(flat[offset : offset + t.numel()].view(t.shape), t.dtype)
            offset += t.numel()
            if inplace:
                t.detach().copy_(piece)
            else:
                out[i] = piece
    return out


def _start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
    packed = pack(req.tensors)
    group = req.options["group"]
    works, finish = launch([flat for _, flat in packed], ReduceOp(req.op), req.pre, req.post, group)

    def result() -> list[torch.Tensor]:
        finish()
        return unpack(req.tensors, packed, req.options["inplace"])

    return works, result


def _neutral(desc: dict[str, Any]) -> Request:
    op = ReduceOp(desc["op"])
    tensors = [neutral_tensor(shape, getattr(torch, d), op) for d, shape, _ in desc["tensors"]]
    return Request(
        Kind.GROUPED_ALLREDUCE,
        None,
        tensors,
        _start,
        op=int(op),
        options={"group": None, "inplace": True},
    )


NEUTRAL[Kind.GROUPED_ALLREDUCE] = _neutral


def submit_grouped(
    tensors: list[torch.Tensor],
    op: ReduceOp,
    pre: float,
    post: float,
    ps: ProcessSet,
    inplace: bool,
    name: str | None = None,
    blocking: bool = True,
) -> Handle:
    """Negotiate and start one grouped all-reduce with resolved arguments."""
    req = Request(
        Kind.GROUPED_ALLREDUCE,
        name,
        tensors,
        _start,
        op=int(op),
        pre=pre,
        post=post,
        options={"group": ps.group, "inplace": inplace},
    )
    return controller(ps).submit(req, blocking)


def check_tensors(tensors: Any, what: str = "tensors") -> list[torch.Tensor]:
    """``tensors`` as a non-empty list of tensors (a TypeError / ValueError names the problem)."""
    check_instance(what, tensors, list | tuple, "a list of tensors", where="hvd")
    tensors = list(tensors)
    with part_of(what, tensors, "hvd"):
        for i, t in enumerate(tensors):
            check_tensor(f"{what}[{i}]", t)
    if not tensors:
        raise ValueError(f"{what} must hold at least one tensor, got an empty list")
    return tensors


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start reducing copies of ``tensors`` together; the result is a list of new tensors."""
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_grouped(
        check_tensors(tensors), op, prescale_factor, postscale_factor, ps, False, name, False
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start reducing ``tensors`` together, in place; the result is the same list."""
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_grouped(
        check_tensors(tensors), op, prescale_factor, postscale_factor, ps, True, name, False
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduce ``tensors`` together (one collective per dtype) and return new tensors.

    Differentiable: with tensors that require grad, each travels in its own all-reduce.
    """
    tensors = check_tensors(tensors)
    check_compression(compression)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [
            allreduce(
                t,
                average,
                None if name is None else f"{name}.{i}",
                compression,
                op,
                prescale_factor,
                postscale_factor,
                process_set,
            )
            for i, t in enumerate(tensors)
        ]
    op, ps = resolve_op(op, average), resolve(process_set)
    packed = [compression.compress(t) for t in tensors]
    handle = submit_grouped(
        [w for w, _ in packed], op, prescale_factor, postscale_factor, ps, False, name
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(handle.wait(), packed)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduce ``tensors`` together in place and return them."""
    op, ps = resolve_op(op, average), resolve(process_set)
    return submit_grouped(
        check_tensors(tensors), op, prescale_factor, postscale_factor, ps, True, name
    ).wait()
