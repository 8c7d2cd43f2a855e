"""Find the rank that is consistently slower than the others, from cheap per-rank timings.

In synchronous data parallel a slow rank does not look slow: every rank's *step* takes as long
as the slowest one's, because the fast ranks wait inside the gradient all-reduce. What differs
is the time a rank spends outside communication. So each rank reports, every ``N`` steps, its
compute time (step time minus time blocked in collectives) and its wait time, in one small
all-gather; every rank runs the same pure :class:`StragglerDetector` on the gathered numbers and
reaches the same verdict without further communication.

The rule: in each report the candidate is the rank with the largest compute time and its
factor is that time over the median of the other ranks'. A single report proves little (a GC
pause, a page-cache miss, a noisy neighbour for a moment), so a rank is named only when it is
the candidate with ``factor >= threshold`` in ``patience`` consecutive reports. The median of
the others (not their mean) keeps one other slow rank from hiding the straggler.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StragglerDetector", "StragglerFinding"]


@dataclass(frozen=True)
class StragglerFinding:
    """A rank that was consistently slower than the others."""

    rank: int
    factor: float
    """Its compute time over the median of the other ranks'."""
    compute: tuple[float, ...]
    """Seconds of compute per step, by rank, in the latest report."""
    wait: tuple[float, ...]
    """Seconds blocked in collectives per step, by rank, in the latest report."""

    def describe(self) -> str:
        """One line for the log."""
        others = [c for r, c in enumerate(self.compute) if r != self.rank]
        return (
            f"rank {self.rank} is {self.factor:.2f}x slower than the median of the others "
            f"(compute {1e3 * self.compute[self.rank]:.1f} ms vs "
            f"{1e3 * statistics.median(others):.1f} ms per step); waiting in collectives per "
            f"step: {', '.join(f'rank {r} {1e3 * w:.1f} ms' for r, w in enumerate(self.wait))}"
        )


class StragglerDetector:
    """Names a rank whose compute time stays ``threshold`` times the others' for a while.

    Args:
        world_size: Number of ranks (>= 2).
        threshold: Factor over the median of the others that counts as slow (> 1).
        patience: Consecutive reports the same rank must be slow before it is named (>= 1).
    """

    def __init__(self, world_size: int, threshold: float = 1.2, patience: int = 2) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 to compare ranks, got {world_size}")
        if threshold <= 1:
            raise ValueError(f"threshold must be > 1, got {threshold}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.world_size, self.threshold, self.patience = world_size, threshold, patience
        self._candidate = -1
        self._streak = 0

    def observe(self, compute: Sequence[float], wait: Sequence[float]) -> StragglerFinding | None:
        """Feed one report (per-rank seconds per step); returns a finding or None."""
        if len(compute) != self.world_size or len(wait) != self.world_size:
            raise ValueError(
                f"expected {self.world_size} values per report, got {len(compute)} compute "
                f"and {len(wait)} wait"
            )
        rank = max(range(self.world_size), key=lambda r: compute[r])
        others = statistics.median(c for r, c in enumerate(compute) if r != rank)
        factor = compute[rank] / others if others > 0 else float("inf")
        if factor < self.threshold:
            self._candidate, self._streak = -1, 0
            return None
        self._streak = self._streak + 1 if rank == self._candidate else 1
        self._candidate = rank
        if self._streak < self.patience:
            return None
        return StragglerFinding(rank, factor, tuple(compute), tuple(wait))
