"""Exactly-once and staleness bookkeeping for a parameter server, plus the SSP wait rule.

Exactly once: a worker that times out and resends, or restarts from a checkpoint and replays
steps, must not have its gradient applied twice. The server keys every PUSH by
``(worker, step)`` and applies only the first.

Staleness: in asynchronous training a gradient computed on version ``v`` is applied to version
``v' >= v``; ``v' - v`` is its staleness (Dean et al. 2012, "Large Scale Distributed Deep
Networks"; Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server"). The ledger keeps its histogram, the first thing to look at when
asynchronous training converges worse than synchronous.

Stale synchronous parallel (SSP, Ho et al. 2013): a worker at clock ``c`` may start its next step
only while ``c - c_min <= bound``, ``c_min`` being the clock of the slowest *live* worker (a dead
worker must not block the others for ever). ``bound = 0`` is bulk-synchronous training.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

__all__ = ["Ledger", "may_proceed", "slowest"]


class _Steps:
    """An exact set of accepted steps, compact for the usual in-order stream.

    ``[lo, hi)`` holds steps accepted contiguously; ``sparse`` the others. In-order steps only
    move ``hi``, so memory stays constant however long training runs.
    """

    def __init__(self, step: int) -> None:
        self.lo, self.hi = step, step + 1
        self.sparse: set[int] = set()

    def add(self, step: int) -> bool:
        if self.lo <= step < self.hi or step in self.sparse:
            return False
        if step == self.hi:
            self.hi += 1
            while self.hi in self.sparse:
                self.sparse.remove(self.hi)
                self.hi += 1
        elif step == self.lo - 1:
            self.lo -= 1
            while self.lo - 1 in self.sparse:
                self.sparse.remove(self.lo - 1)
                self.lo -= 1
        else:
            self.sparse.add(step)
        return True

    def __len__(self) -> int:
        return self.hi - self.lo + len(self.sparse)


def _nonnegative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


class Ledger:
    """Which ``(worker, step)`` updates were applied, and how stale they were."""

    def __init__(self) -> None:
        self._steps: dict[int, _Steps] = {}
        self._staleness: dict[int, Counter[int]] = {}

    def accept(self, worker: int, step: int) -> bool:
        """Record ``(worker, step)``; ``False`` when it was accepted before (a duplicate)."""
        _nonnegative(worker=worker, step=step)
        if worker not in self._steps:
            self._steps[worker] = _Steps(step)
            return True
        return self._steps[worker].add(step)

    def accepted(self, worker: int) -> int:
        """Number of distinct steps accepted from ``worker``."""
        steps = self._steps.get(worker)
        return len(steps) if steps is not None else 0

    def record(self, worker: int, pulled_version: int, server_version: int) -> int:
        """Record one applied update's staleness and return it.

        Raises:
            ValueError: when ``pulled_version`` is newer than ``server_version`` (the worker
                claims a version the server never served), naming both and the worker.
        """
        _nonnegative(worker=worker, pulled_version=pulled_version, server_version=server_version)
        if pulled_version > server_version:
            raise ValueError(
                f"worker {worker}: pulled_version={pulled_version} is newer than "
                f"server_version={server_version}"
            )
        staleness = server_version - pulled_version
        self._staleness.setdefault(worker, Counter())[staleness] += 1
        return staleness

    def histogram(self, worker: int | None = None) -> dict[int, int]:
        """Staleness -> number of updates, sorted by staleness; one worker's or everyone's."""
        if worker is not None:
            total = self._staleness.get(worker, Counter())
        else:
            total = sum(self._staleness.values(), Counter())
        return dict(sorted(total.items()))

    def max_staleness(self) -> int:
        """Largest staleness recorded so far (0 when nothing was recorded)."""
        return max(self.histogram(), default=0)


def slowest(clocks: Mapping[int, int], alive: Collection[int]) -> int:
    """The live worker with the smallest clock (lowest index on ties).

    Args:
        clocks: Worker -> number of steps it has completed.
        alive: The workers still alive; the others are ignored.

    Raises:
        ValueError: when no worker is alive, or a live worker has no clock (naming it).
    """
    if not alive:
        raise ValueError(f"no live worker among clocks for workers {sorted(clocks)}")
    unknown = sorted(w for w in alive if w not in clocks)
    if unknown:
        raise ValueError(f"alive workers {unknown} have no entry in clocks {dict(clocks)}")
    return min(alive, key=lambda w: (clocks[w], w))


def may_proceed(
    worker_clock: int,
    clocks: Mapping[int, int],
    bound: int,
    alive: Collection[int] | None = None,
) -> bool:
    """The SSP rule: may a worker at ``worker_clock`` start its next step?

    Args:
        worker_clock: The asking worker's clock.
        clocks: Worker -> clock, for every worker the server knows.
        bound: Staleness bound ``s`` >= 0; 0 is fully synchronous.
        alive: Live workers (default: every worker in ``clocks``); dead ones do not hold back.

    Returns:
        ``worker_clock - slowest_live_clock <= bound``.
    """
    _nonnegative(bound=bound, worker_clock=worker_clock)
    live = clocks.keys() if alive is None else alive
    return worker_clock - clocks[slowest(clocks, live)] <= bound
