"""Pure shard arithmetic: which slice of a dimension each tensor-parallel rank holds.

Sizes differ by at most one and the larger shards come first (``numpy.array_split``'s rule), so
a dimension that does not divide by ``tp`` -- the 65-character vocabulary on 2 or 4 ranks --
still splits: 65 on 2 ranks is 33 + 32, on 4 ranks 17 + 16 + 16 + 16. Layers, the vocabulary-
parallel loss and the uneven all-gather all use these two functions, so they agree on the
layout without communicating it.
"""

from __future__ import annotations

__all__ = ["shard_range", "shard_sizes"]


def shard_sizes(total: int, tp: int) -> list[int]:
    """Length of every rank's shard of a dimension of ``total`` elements split over ``tp`` ranks.

    Raises:
        ValueError: if ``tp < 1`` or ``total < 0``.
    """
    if tp < 1:
        raise ValueError(f"shard_sizes: tp must be >= 1, got tp={tp}")
    if total < 0:
        raise ValueError(f"shard_sizes: total must be >= 0, got total={total}")
    base, extra = divmod(total, tp)
    return [base + (1 if r < extra else 0) for r in range(tp)]


def shard_range(total: int, rank: int, tp: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s shard: it holds indices ``start <= i < end``.

    Raises:
        ValueError: if ``rank`` is not in ``[0, tp)`` (or as :func:`shard_sizes`).
    """
    if not 0 <= rank < tp:
        raise ValueError(f"shard_range: rank must be in [0, tp), got rank={rank}, tp={tp}")
    base, extra = divmod(total, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
