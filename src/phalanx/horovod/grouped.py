"""Horovod's grouped all-reduce: many tensors, one collective per (device, dtype).

The tensors are packed into one flat buffer per device and dtype, reduced together (one launch
latency instead of one per tensor) and unpacked into new tensors, or back in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from phalanx.horovod.allreduce import ReduceOp, allreduce, launch, resolve_op
from phalanx.horovod.basics import ProcessSet, check_group
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.handle import Handle

__all__ = [
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_async",
]


def grouped_async(
    tensors: Sequence[torch.Tensor], op: ReduceOp, pre: float, post: float, group: ProcessSet,
    inplace: bool,
) -> Handle:  # fmt: skip
    """All-reduce ``tensors`` as one flat buffer per (device, dtype), with resolved arguments."""
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.device, t.dtype), []).append(i)
    flats = [torch.cat([tensors[i].detach().reshape(-1) for i in idx]) for idx in kinds.values()]
    works, finish = launch(flats, op, pre, post, group)

    def result() -> list[torch.Tensor]:
        finish()
        out: list[torch.Tensor] = list(tensors)
        for flat, idx in zip(flats, kinds.values()):
            offset = 0
            for i in idx:
                t = tensors[i]
                piece = flat[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
                if inplace:
                    t.detach().copy_(piece)
                else:
                    out[i] = piece
        return out

    return Handle(works, result)


def _check_tensors(tensors: Any) -> list[torch.Tensor]:
    tensors = list(tensors)
    bad = [i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"tensors must be a list of tensors; entries {bad} are not tensors")
    return tensors


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start reducing copies of ``tensors`` together; the result is a list of new tensors."""
    op, group = resolve_op(op, average), check_group(process_set)
    return grouped_async(_check_tensors(tensors), op, prescale_factor, postscale_factor,
                          group, inplace=False)  # fmt: skip


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> Handle:  # fmt: skip
    """Start reducing ``tensors`` together, in place; the result is the same list."""
    op, group = resolve_op(op, average), check_group(process_set)
    return grouped_async(_check_tensors(tensors), op, prescale_factor, postscale_factor,
                          group, inplace=True)  # fmt: skip


def grouped_allreduce(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, process_set: ProcessSet = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Reduce ``tensors`` together (one collective per dtype) and return new tensors."""
    tensors = _check_tensors(tensors)
    check_compression(compression)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor,
                          process_set) for t in tensors]  # fmt: skip
    packed = [compression.compress(t) for t in tensors]
    handle = grouped_allreduce_async([w for w, _ in packed], average, name, op,
                                     prescale_factor, postscale_factor, process_set)  # fmt: skip
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(handle.wait(), packed)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Reduce ``tensors`` together in place and return them."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                      postscale_factor, process_set)  # fmt: skip
    return handle.wait()
