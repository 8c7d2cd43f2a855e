"""What a timeline is made of: one rank's phases, waits and operations, on one clock.

A :class:`RankTimeline` holds, for one rank, the stretches of its training loop
(:class:`Segment`: a phase of a step), the stretches its training thread was blocked on
communication (waits), and every collective and point-to-point operation it issued
(:class:`Op`), all in seconds of rank 0's clock once merged (:mod:`.merge`). Its lookups
(which segment or wait holds a moment, which operations completed in a wait) are what the
critical path (:mod:`.critical_path`) walks on: each is a bisection on sorted arrays.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["OTHER", "Op", "RankTimeline", "Segment"]

OTHER = "other"
"""The phase of time the job did not mark as a step's (between epochs, evaluation, set-up)."""


@dataclass
class Op:
    """One collective or point-to-point operation as one rank issued it."""

    group: str
    """The process group's name (``p2p`` for point-to-point operations)."""
    seq: int
    """The collective's sequence number in its group (P2P: this rank's own counter)."""
    op: str
    shape: str
    args: str
    site: str
    start: float
    """When this rank entered it (a P2P operation: when this rank began to wait for it)."""
    end: float | None
    """When it completed on this rank (None: never seen completing)."""
    peer: int | None = None
    """P2P only: the other global rank (-1: any rank)."""
    idle: bool = False
    """A wait for work to arrive (a server's next request): never a straggler's fault."""
    rank: int = -1
    """The rank that issued it (set when ranks are merged)."""
    last_rank: int | None = None
    """The rank that arrived last at this operation (set when ranks are merged)."""
    last_start: float | None = None
    """When that rank arrived."""
    key: str = ""
    """The operation's identity across ranks (``group#seq``, ``p2p:src>dst#n``)."""

    @property
    def is_p2p(self) -> bool:
        return self.peer is not None


@dataclass(frozen=True)
class Segment:
    """A stretch of one rank's loop in one phase."""

    start: float
    end: float
    phase: str
    """``data``, ``forward``, ``backward``, ``optimizer`` or :data:`OTHER`."""
    step: int | None
    """The step it belongs to: the job's step count once that step is done (None: after the
    last step the job completed)."""


@dataclass
class RankTimeline:
    """One rank's segments, waits and operations, sorted; see the module's docstring."""

    rank: int
    host: str
    segments: list[Segment]
    waits: list[tuple[float, float]]
    """Blocked stretches of the training thread, ``(start, end)``, sorted, not overlapping."""
    ops: list[Op]
    _seg_starts: list[float] = field(init=False, repr=False)
    _wait_starts: list[float] = field(init=False, repr=False)
    _wait_ends: list[float] = field(init=False, repr=False)
    _by_end: list[Op] = field(init=False, repr=False)
    _op_ends: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.segments.sort(key=lambda s: s.start)
        self.waits = _union(self.waits)
        self.ops.sort(key=lambda o: o.start)
        self._seg_starts = [s.start for s in self.segments]
        self._wait_starts = [w[0] for w in self.waits]
        self._wait_ends = [w[1] for w in self.waits]
        self._by_end = sorted((o for o in self.ops if o.end is not None), key=_end)
        self._op_ends = [_end(o) for o in self._by_end]

    @property
    def end(self) -> float:
        """When this rank's last segment ends (-inf without segments)."""
        return self.segments[-1].end if self.segments else float("-inf")

    def segment_at(self, t: float) -> Segment | None:
        """The segment with ``start < t <= end``."""
        i = bisect.bisect_left(self._seg_starts, t) - 1
        if i >= 0 and t <= self.segments[i].end:
            return self.segments[i]
        return None

    def wait_at(self, t: float) -> tuple[float, float] | None:
        """The wait with ``start < t <= end``."""
        i = bisect.bisect_left(self._wait_starts, t) - 1
        if i >= 0 and t <= self.waits[i][1]:
            return self.waits[i]
        return None

    def wait_end_before(self, t: float) -> float:
        """The end of the last wait that ended before ``t`` (-inf: none)."""
        i = bisect.bisect_left(self._wait_ends, t) - 1
        return self._wait_ends[i] if i >= 0 else float("-inf")

    def ops_ending(self, lo: float, hi: float) -> list[Op]:
        """The operations that completed within ``[lo, hi]``."""
        i = bisect.bisect_left(self._op_ends, lo)
        j = bisect.bisect_right(self._op_ends, hi)
        return self._by_end[i:j]

    def waited(self, lo: float, hi: float) -> float:
        """Seconds this rank was blocked within ``[lo, hi]``."""
        total = 0.0
        i = max(0, bisect.bisect_left(self._wait_ends, lo))
        for start, end in self.waits[i:]:
            if start >= hi:
                break
            total += max(0.0, min(end, hi) - max(start, lo))
        return total


def _end(op: Op) -> float:
    assert op.end is not None
    return op.end


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping stretches joined (waits counted from several threads can overlap)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
