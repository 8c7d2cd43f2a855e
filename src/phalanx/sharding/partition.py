"""Pure partitioning of flattened parameters across data-parallel ranks (ZeRO).

The parameters are concatenated into one flat vector of ``total`` elements and split into
``world`` contiguous ranges whose sizes differ by at most one element: every element is owned by
exactly one rank. Collectives need equal chunks, so each rank's range is padded to
``chunk = ceil(total / world)`` elements in the staging buffer.
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


def partition(total: int, world: int) -> Partition:
    """Split ``total`` elements into ``world`` contiguous ranges, sizes within one element."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    base, extra = divmod(total, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return Partition(total, tuple(bounds))
