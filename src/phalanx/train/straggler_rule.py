"""Name the rank that is consistently slower than the others, and the phase that makes it slow.

In synchronous training a slow rank does not look slow: every rank's *step* takes as long as
the slowest one's, because the fast ranks wait inside communication. What differs is where a
rank spends the time it does not wait. Each rank reports, per window (one step, as the job's
monitor feeds it), its compute per phase (data, forward, backward, optimizer; communication
wait taken out, see :mod:`phalanx.train.phases`) and its total wait; every rank runs the same
pure :class:`StragglerDetector` on the gathered reports and reaches the same verdict.

The rule, per window, for each rank ``r`` and compute phase ``p``: the *excess* is ``r``'s time
in ``p`` minus the median of the other ranks' (the median, so one other slow rank cannot hide
the straggler). It counts only above a margin, the largest of

- an absolute floor (``min_ms``),
- a share of the median step time (``relative``): a slowdown that small is not worth a warning,
- ``z`` times the phase's noise: a high quantile (``quantile``) of the window-to-window changes
  of the *other* ranks' times in that phase over the last ``history`` windows. A busy machine
  raises the bar; the noise that fools a detector is bursty (a rank descheduled for a few
  steps), so a high quantile, not the typical jitter; and a straggler's own jump at its onset
  never raises its own bar.

A (rank, phase) is named when it stays above its margin in ``patience`` consecutive windows,
after ``warmup`` windows (set-up is slow). Communication is judged like a phase, with the
rank's wait, but counts only for a rank that computes no less than the others: in lock-step
training a longer wait mirrors another rank's longer compute, which is what is named then; a
rank that waits longer *without* computing less waits on communication itself (a slow link or
peer).

On a 2-core machine with a CPU hog beside 4 ranks, the noise in backward reaches ~30 ms for 3
steps in a row (a rank descheduled): ``patience=4`` and the quantile margin keep such bursts
from being named (``tools/straggler_trials.py`` measures both sides).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx.train.phases import COMPUTE_PHASES, PHASES

__all__ = ["StragglerDetector", "StragglerFinding", "StragglerRule"]

_COMM = len(COMPUTE_PHASES)


@dataclass(frozen=True)
class StragglerRule:
    """When a rank's phase counts as slow, and for how long before it is named."""

    min_ms: float = 5.0
    """Absolute floor of the margin, in milliseconds per step."""
    relative: float = 0.1
    """The margin is at least this fraction of the median step time."""
    z: float = 2.0
    """The margin is at least ``z`` times the phase's noise (see ``quantile``)."""
    quantile: float = 0.9
    """The phase's noise: this quantile of the window-to-window changes of the other ranks'
    times in it (never the judged rank's own), over the last ``history`` windows. A high
    quantile, because the noise that fools a detector is bursty (a rank descheduled for a few
    steps), not the typical jitter."""
    patience: int = 4
    """Consecutive windows the same rank and phase must stand out in before it is named."""
    warmup: int = 5
    """Windows ignored at the start (neither judged nor learnt from: set-up is slow)."""
    history: int = 32
    """Windows of changes the noise is taken over."""

    def __post_init__(self) -> None:
        for name, positive in (("min_ms", True), ("relative", False), ("z", False)):
            self._check_number(name, positive)
        if not 0 < self.quantile <= 1:
            raise ValueError(f"StragglerRule: quantile must be in (0, 1], got {self.quantile!r}")
        for name, low in (("patience", 1), ("warmup", 0), ("history", 2)):
            value = vars(self)[name]  # a field, by name
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"StragglerRule: {name} must be an int >= {low}, got {value!r}")

    def _check_number(self, name: str, positive: bool) -> None:
        value = vars(self)[name]  # a field, by name
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"StragglerRule: {name} must be a number {bound}, got {value!r}")


@dataclass(frozen=True)
class StragglerFinding:
    """A rank that stood out in one phase for ``windows`` consecutive windows."""

    rank: int
    phase: str
    """One of ``phalanx.train.phases.PHASES``."""
    excess: float
    """Seconds per step above the median of the other ranks, in that phase (latest window)."""
    margin: float
    """The margin it exceeded, seconds per step."""
    factor: float
    """Its compute time (all compute phases) over the median of the other ranks'."""
    windows: int
    """Consecutive windows it stood out in."""
    ranks: tuple[int, ...]
    """The ranks compared, in report order."""
    compute: tuple[tuple[float, ...], ...] = field(repr=False)
    """Seconds of compute per step, by compute phase, for each rank of ``ranks``."""
    wait: tuple[float, ...] = field(repr=False)
    """Seconds of communication wait per step for each rank of ``ranks``."""

    def describe(self) -> str:
        """One line for the log."""
        i = self.ranks.index(self.rank)
        p = PHASES.index(self.phase)
        column = [w for w in self.wait] if p == _COMM else [c[p] for c in self.compute]
        others = statistics.median(v for j, v in enumerate(column) if j != i)
        waits = ", ".join(f"rank {r} {1e3 * w:.1f} ms" for r, w in zip(self.ranks, self.wait))
        return (
            f"rank {self.rank} is slow in {self.phase}: {1e3 * column[i]:.1f} ms per step vs "
            f"{1e3 * others:.1f} ms, the median of the other ranks (+{1e3 * self.excess:.1f} ms, "
            f"margin {1e3 * self.margin:.1f} ms, {self.windows} steps in a row); its compute "
            f"is {self.factor:.2f}x theirs; waiting in communication per step: {waits}"
        )


@dataclass(frozen=True)
class _Candidate:
    rank: int
    phase: int
    excess: float
    margin: float


def _others(values: Sequence[float], i: int) -> float:
    return statistics.median(v for j, v in enumerate(values) if j != i)


def _medians_of_others(values: Sequence[float]) -> list[float]:
    """For each entry, the median of all the other entries (one sort for all of them)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranked = [values[i] for i in order]
    m = len(values) - 1  # how many others

    def other(j: int, k: int) -> float:  # the j-th smallest of the others of rank-k entry
        return ranked[j] if j < k else ranked[j + 1]

    out = [0.0] * len(values)
    for k, i in enumerate(order):
        half = m // 2
        out[i] = other(half, k) if m % 2 else (other(half - 1, k) + other(half, k)) / 2
    return out


class StragglerDetector:
    """Names a (rank, phase) that stands out by a margin in ``rule.patience`` windows in a row.

    Args:
        ranks: The ranks compared (their labels in findings), or how many (labels 0..n-1).
        rule: The margin and persistence, see :class:`StragglerRule`.
    """

    def __init__(self, ranks: int | Sequence[int], rule: StragglerRule | None = None) -> None:
        labels = tuple(range(ranks)) if isinstance(ranks, int) else tuple(ranks)
        if len(labels) < 2:
            raise ValueError(f"StragglerDetector: need >= 2 ranks to compare, got {ranks!r}")
        self.ranks, self.rule = labels, rule or StragglerRule()
        history = self.rule.history
        self._changes = [[deque[float](maxlen=history) for _ in labels] for _ in PHASES]
        """Per phase, per rank: its recent window-to-window changes."""
        self._last: list[list[float]] | None = None
        self._windows = 0
        self._streaks: dict[tuple[int, int], int] = {}
        """Per (rank, phase) standing out: for how many windows in a row."""
        self.current: StragglerFinding | None = None
        """The finding while its rank and phase keep standing out; None otherwise."""

    def observe(self, report: Sequence[Sequence[float]]) -> StragglerFinding | None:
        """Feed one window: per rank, seconds per step of compute per compute phase and of wait.

        Returns a finding when a (rank, phase) has just been named (once per episode; see
        :attr:`current` for whether it still stands out).
        """
        rows = self._check(report)
        self._windows += 1
        if self._windows <= self.rule.warmup:
            return None
        self._learn(rows)
        self._last = rows
        if not self._changes[0][0]:  # no noise learnt yet, nothing to judge by
            return None
        over = {_key(c): c for c in self._standing_out(rows)}
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in over}
        patience = self.rule.patience
        ready = [c for k, c in over.items() if self._streaks[k] >= patience]
        self.current = self._finding(max(ready, key=_ratio), rows) if ready else None
        new = [c for k, c in over.items() if self._streaks[k] == patience]  # once per episode
        return self._finding(max(new, key=_ratio), rows) if new else None

    def _check(self, report: Sequence[Sequence[float]]) -> list[list[float]]:
        if len(report) != len(self.ranks) or any(len(row) != len(PHASES) for row in report):
            shapes = [len(row) for row in report]
            raise ValueError(
                f"StragglerDetector.observe: expected {len(self.ranks)} rows of {len(PHASES)} "
                f"values ({', '.join(COMPUTE_PHASES)} compute, then wait), got row lengths "
                f"{shapes}"
            )
        return [[float(v) for v in row] for row in report]

    def _learn(self, rows: list[list[float]]) -> None:
        if self._last is None:
            return
        for p, by_rank in enumerate(self._changes):
            for changes, now, before in zip(by_rank, rows, self._last):
                changes.append(abs(now[p] - before[p]))

    def _margin(self, p: int, rank: int, floor: float) -> float:
        """The bar for ``rank`` in phase ``p``: from the *other* ranks' noise, so that a
        straggler's own jump at its onset does not raise its own bar."""
        changes = sorted(
            c for r, by_rank in enumerate(self._changes[p]) if r != rank for c in by_rank
        )
        noise = changes[min(len(changes) - 1, int(self.rule.quantile * len(changes)))]
        return max(floor, self.rule.z * noise)

    def _standing_out(self, rows: list[list[float]]) -> list[_Candidate]:
        """Every (rank, phase) above its margin in this window."""
        step = statistics.median(sum(row) for row in rows)
        floor = max(self.rule.min_ms / 1e3, self.rule.relative * step)
        out = [c for p in range(_COMM) for c in self._above(rows, p, floor)]
        totals = [sum(row[:_COMM]) for row in rows]
        for c in self._above(rows, _COMM, floor):
            # Waiting longer without computing less: its communication itself is slow. (In
            # lock step a longer wait mirrors another rank's longer compute: not this.)
            if _others(totals, c.rank) - totals[c.rank] < c.margin / 2:
                out.append(c)
        return out

    def _above(self, rows: list[list[float]], p: int, floor: float) -> list[_Candidate]:
        column = [row[p] for row in rows]
        excess = [v - m for v, m in zip(column, _medians_of_others(column))]
        out = []
        for r, e in enumerate(excess):
            if e > floor:  # the common case is not: no need for the noise scale then
                margin = self._margin(p, r, floor)
                if e > margin:
                    out.append(_Candidate(r, p, e, margin))
        return out

    def _finding(self, best: _Candidate, rows: list[list[float]]) -> StragglerFinding:
        totals = [sum(row[:_COMM]) for row in rows]
        others = _others(totals, best.rank)
        factor = totals[best.rank] / others if others > 0 else math.inf
        return StragglerFinding(
            rank=self.ranks[best.rank],
            phase=PHASES[best.phase],
            excess=best.excess,
            margin=best.margin,
            factor=factor,
            windows=self._streaks[_key(best)],
            ranks=self.ranks,
            compute=tuple(tuple(row[:_COMM]) for row in rows),
            wait=tuple(row[_COMM] for row in rows),
        )


def _key(c: _Candidate) -> tuple[int, int]:
    return c.rank, c.phase


def _ratio(c: _Candidate) -> float:
    return c.excess / c.margin
