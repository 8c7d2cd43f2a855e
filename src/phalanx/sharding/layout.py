"""Pure layout of ZeRO-1/2 shards: parameters -> buckets -> one balanced range per rank.

Parameters (per parameter group, in reverse registration order, as DDP buckets them) are packed
into buckets; the buckets are laid end to end in one flat buffer that the parameters become
views of. Each bucket is split by :func:`~phalanx.sharding.partition.partition` into ``world``
contiguous ranges (sizes within one element), so a rank's shard of a bucket is one contiguous
slice of the flat buffer: the optimizer steps that slice in place.

Collectives need equal chunks: a bucket travels as a *staging* buffer of ``world * chunk`` elements
in which rank ``r``'s range sits at ``r * chunk`` followed by at most one padding element.
:class:`StagingRun` records where each run of a parameter's elements lands in it: a
:class:`~phalanx.sharding.pieces.Piece` of the flattened parameter (key ``param<i>``) whose offset
is its place in the staging buffer, and the rank that owns it. The extra element of uneven
buckets rotates over the ranks from bucket to bucket, so every rank's total is within one element
of the others' (not only within each bucket).

With ``flags``, each rank's chunk ends with one *gradient flag* per parameter of the bucket:
every rank writes 1 where it holds a gradient for that parameter, so after the reduce-scatter a
rank knows how many ranks had one, from the same collective (no extra round trip): a parameter
that no rank has a gradient for is skipped by the optimizer, as ``torch.optim`` skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.data_parallel.buckets import ParamSpec, plan_buckets
from phalanx.sharding.partition import Partition, partition
from phalanx.sharding.pieces import Piece, param_index, param_key

__all__ = ["BucketLayout", "CopyRun", "ShardLayout", "StagingRun", "plan_shards"]


@dataclass(frozen=True)
class StagingRun:
    """A run of one parameter's elements, owned by ``rank``, in a bucket's staging buffer."""

    piece: Piece
    """Elements of the flattened parameter (key ``param<i>``, shape ``(numel,)``); its offset
    is where they sit in the bucket's staging buffer."""
    rank: int
    param: int = field(init=False, repr=False, compare=False)
    """The parameter's global index (read from the key once, for the per-step copies)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "param", param_index(self.piece.key))


CopyRun = tuple[int, slice, slice]
"""A staging run precomputed for a per-step copy loop: (parameter index, where its elements sit
in a staging buffer, which elements of the flattened parameter they are)."""


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its parameters, where it lies in the flat buffer, and its partition."""

    group: int
    params: tuple[int, ...]
    """Global parameter indices, in bucket order."""
    offsets: tuple[int, ...]
    """Offset of each parameter inside the bucket."""
    flat_offset: int
    part: Partition
    segments: tuple[StagingRun, ...]
    flags: int = 0
    """Gradient flags at the end of each rank's chunk (0, or one per parameter)."""

    @property
    def numel(self) -> int:
        return self.part.total

    @property
    def chunk(self) -> int:
        """Elements per rank in the staging buffer: the largest range, then the flags."""
        return self.part.chunk + self.flags

    @property
    def flag_offset(self) -> int:
        """Where the flags start inside a rank's chunk (flag ``j`` is for ``params[j]``)."""
        return self.part.chunk

    def copy_runs(self) -> list[CopyRun]:
        """Every run, precomputed for the gradient copy into the staging buffer."""
        return [(s.param, s.piece.held, s.piece.elements) for s in self.segments]

    def shard(self, rank: int) -> tuple[int, int]:
        """``rank``'s range in flat-buffer coordinates."""
        s, e = self.part.bounds[rank]
        return self.flat_offset + s, self.flat_offset + e


@dataclass(frozen=True)
class ShardLayout:
    """Every bucket of every parameter group, end to end in one flat buffer."""

    world: int
    numels: tuple[int, ...]
    """Elements of each parameter (global index)."""
    buckets: tuple[BucketLayout, ...]

    @property
    def total(self) -> int:
        return sum(self.numels)

    def param_offset(self, index: int) -> int:
        """Where parameter ``index`` starts in the flat buffer."""
        for b in self.buckets:
            if index in b.params:
                return b.flat_offset + b.offsets[b.params.index(index)]
        raise KeyError(f"parameter {index} is in no bucket")


def _segments(
    params: list[int], offsets: list[int], numels: list[int], part: Partition, flags: bool
) -> list[StagingRun]:
    out = []
    chunk = part.chunk + (len(params) if flags else 0)
    for p, off, n in zip(params, offsets, numels):
        for r, (s, e) in enumerate(part.bounds):
            lo, hi = max(off, s), min(off + n, e)
            if lo < hi:
                piece = Piece(param_key(p), (n,), lo - off, hi - off, r * chunk + lo - s)
                out.append(StagingRun(piece, r))
    return out


def plan_shards(
    groups: list[list[int]],
    world: int,
    element_size: int,
    cap_bytes: int,
    *,
    reverse: bool = True,
    flags: bool = False,
) -> ShardLayout:
    """Lay out parameter groups (each a list of element counts, global order) for ``world``.

    Buckets never span groups (each group keeps its own hyperparameters). A parameter larger
    than ``cap_bytes`` gets a bucket of its own. ``reverse`` packs each group's parameters last
    first (the order backward produces gradients in); otherwise in registration order. Planning
    more groups later appends buckets and leaves the earlier ones unchanged.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    numels = [n for g in groups for n in g]
    buckets: list[BucketLayout] = []
    flat = first = extra = 0
    for gi, group in enumerate(groups):
        specs = [ParamSpec(first + i, n, element_size, "f", "d") for i, n in enumerate(group)]
        first += len(group)
        order = specs if reverse else specs[::-1]  # plan_buckets walks its input backwards
        for plan in plan_buckets(order, [cap_bytes]) if specs else []:
            part = partition(plan.numel, world, extra % world)
            extra += plan.numel % world
            sizes = [numels[p] for p in plan.params]
            segs = _segments(list(plan.params), list(plan.offsets), sizes, part, flags)
            n_flags = len(plan.params) if flags else 0
            buckets.append(
                BucketLayout(gi, plan.params, plan.offsets, flat, part, tuple(segs), n_flags)
            )
            flat += plan.numel
    return ShardLayout(world, tuple(numels), tuple(buckets))
