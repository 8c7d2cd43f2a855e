"""What one rank's inner optimizer steps under ZeRO-1/2: its ranges of the parameters.

The layout (:mod:`phalanx.sharding.layout`) gives each rank one contiguous range of every
bucket; inside a bucket that range covers whole parameters and, at its two ends, parts of
parameters. Each :class:`OwnedRange` is one parameter's part of it, and holds the tensor the
inner ``torch.optim`` optimizer steps:

- a range that covers a whole parameter is stepped as a tensor shaped like the parameter
  (with ``step_params=True``, the parameter itself: ``zero.optim.state[p]`` is then ``p``'s
  state, as with torch's ``ZeroRedundancyOptimizer``);
- a partial range is a 1-D ``nn.Parameter`` viewing those elements of the parameter.

Either way the optimizer updates the parameter's own storage in place, and each range has its
own gradient: a parameter without one (``grad is None``) is skipped by the optimizer, exactly as
``torch.optim`` skips it, and its state stays as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from phalanx.sharding.layout import ShardLayout

__all__ = ["OwnedRange", "attach_local_grads", "owned_ranges", "refresh", "release_grads"]


@dataclass
class OwnedRange:
    """Elements ``start : start + length`` of flattened parameter ``param``, owned by this rank."""

    param: int
    start: int
    length: int
    bucket: int
    slot: int
    """Offset in this rank's chunk of the bucket's staging buffer."""
    flag: int
    """Position of ``param`` in its bucket (its gradient flag)."""
    tensor: torch.Tensor
    """What the inner optimizer steps (the parameter itself, or a view of it)."""
    whole: bool

    def view_of(self, p: torch.Tensor) -> torch.Tensor:
        """This range of ``p`` (the parameter or a tensor shaped like it), shaped as ``tensor``."""
        return p if self.whole else p.reshape(-1)[self.start : self.start + self.length]


def owned_ranges(
    params: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    *,
    step_params: bool,
    first_bucket: int = 0,
) -> list[list[OwnedRange]]:
    """This rank's ranges, per bucket (buckets ``first_bucket`` onwards)."""
    out = []
    for b in range(first_bucket, len(layout.buckets)):
        bucket = layout.buckets[b]
        base = rank * bucket.chunk
        mine = []
        for seg in bucket.segments:
            if seg.rank != rank:
                continue
            p = params[seg.param]
            whole = seg.length == p.numel()
            if whole and step_params:
                tensor: torch.Tensor = p
            else:
                flat = p.detach().reshape(-1)
                data = p.detach() if whole else flat[seg.param_start : seg.param_start + seg.length]
                tensor = nn.Parameter(data)
            flag = bucket.params.index(seg.param)
            slot = seg.staging - base
            mine.append(
                OwnedRange(seg.param, seg.param_start, seg.length, b, slot, flag, tensor, whole)
            )
        out.append(mine)
    return out


def refresh(ranges: list[list[OwnedRange]], params: Sequence[torch.Tensor]) -> None:
    """Re-point views at their parameters (in case ``p.data`` was replaced since)."""
    for mine in ranges:
        for r in mine:
            p = params[r.param]
            if r.tensor is not p:
                r.tensor.data = r.view_of(p.data)


def attach_local_grads(ranges: list[list[OwnedRange]], params: Sequence[torch.Tensor]) -> None:
    """Give each view the matching slice of its parameter's own gradient (or None)."""
    for mine in ranges:
        for r in mine:
            p = params[r.param]
            if r.tensor is not p:
                r.tensor.grad = None if p.grad is None else r.view_of(p.grad)


def release_grads(ranges: list[list[OwnedRange]], params: Sequence[torch.Tensor]) -> None:
    """Drop the views' gradients (so a parameter's freed gradient is not kept alive)."""
    for mine in ranges:
        for r in mine:
            if r.tensor is not params[r.param]:
                r.tensor.grad = None
