"""Pure partitioning of flattened parameters across data-parallel ranks (ZeRO).

The parameters are concatenated into one flat vector of ``total`` elements and split into
``world`` contiguous ranges whose sizes differ by at most one element: every element is owned by
exactly one rank. Collectives need equal chunks, so each rank's range is padded to
``chunk = ceil(total / world)`` elements in the staging buffer.

When ``total`` does not divide evenly, ``total % world`` ranks get one element more; ``first``
says which (``first``, ``first + 1``, ... modulo ``world``), so a layout of several partitions
can rotate the extra elements and keep every rank's total within one element.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Partition", "partition"]


@dataclass(frozen=True)
class Partition:
    """The flat ranges owned by each rank."""

    total: int
    """Elements in the flattened parameters."""
    bounds: tuple[tuple[int, int], ...]
    """``(start, end)`` per rank, contiguous, covering ``0..total`` exactly once."""

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.bounds)

    @property
    def chunk(self) -> int:
        """Padded per-rank chunk for equal-sized collectives."""
        return max(e - s for s, e in self.bounds) if self.bounds else 0


def partition(total: int, world: int, first: int = 0) -> Partition:
    """Split ``total`` elements into ``world`` contiguous ranges, sizes within one element.

    The ``total % world`` larger ranges go to ranks ``first, first + 1, ...`` (modulo
    ``world``); the ranges stay in rank order either way.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    base, extra = divmod(total, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (1 if (r - first) % world < extra else 0)
        bounds.append((start, start + size))
        start += size
    return Partition(total, tuple(bounds))
