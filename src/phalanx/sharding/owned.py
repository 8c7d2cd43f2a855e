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
from dataclasses import dataclass, field

import torch
from torch import nn

from phalanx.sharding.layout import ShardLayout
from phalanx.sharding.pieces import Piece, param_index

__all__ = ["OwnedRange", "attach_local_grads", "owned_ranges", "refresh", "release_grads"]


@dataclass
class OwnedRange:
    """One parameter's part of this rank's range of a bucket, and what steps it."""

    piece: Piece
    """The elements (key ``param<i>``, the parameter's shape); its offset is their place in this
    rank's chunk of the bucket's staging buffer (where their reduced gradient arrives)."""
    bucket: int
    flag: int
    """Position of the parameter in its bucket (its gradient flag)."""
    tensor: torch.Tensor
    """What the inner optimizer steps (the parameter itself, or a view of it)."""
    whole: bool
    """The piece is the whole parameter (``tensor`` is then shaped like it)."""
    param: int = field(init=False, repr=False)
    """The parameter's global index (read from the key once, for the per-step loops)."""

    def __post_init__(self) -> None:
        self.param = param_index(self.piece.key)

    def view_of(self, p: torch.Tensor) -> torch.Tensor:
        """This range of ``p`` (the parameter or a tensor shaped like it), shaped as ``tensor``."""
        return p if self.whole else p.reshape(-1)[self.piece.start : self.piece.end]


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
            p, run = params[seg.param], seg.piece
            whole = run.numel == p.numel()
            if whole and step_params:
                tensor: torch.Tensor = p
            else:
                tensor = nn.Parameter(p.detach() if whole else run.of_full(p.detach()))
            piece = Piece(run.key, tuple(p.shape), run.start, run.end, run.offset - base)
            mine.append(OwnedRange(piece, b, bucket.params.index(seg.param), tensor, whole))
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
