"""Each step's critical path: which rank, in which phase, the step waited on.

The walk (:func:`walk`) starts where the last rank ended and goes backwards in time. On the
rank at hand, at time ``t``:

- if its training thread was blocked at ``t`` (a wait), the walk asks what released it: of the
  operations this rank issued that completed during the wait, the one whose last rank to
  arrive came latest. If that is another rank, and it arrived after the wait began, the wait
  was for it: the path *jumps* to that rank at its arrival (a :class:`Jump`). Otherwise the
  wait was the transfer itself, which goes on the path as ``communication`` on this rank;
- otherwise the rank was working in a phase of a step: the stretch back to the phase's start
  (or to the end of its previous wait) is on the path.

This is the longest chain of the happens-before graph the operations make (Lamport 1978; the
wait-state analysis of MPI tools, Böhme et al. 2016): lengthen a stretch on it and the run
gets longer by as much; lengthen one off it, up to its slack, and nothing changes.

Each stretch on the path belongs to the step that holds it on its rank. Per step
(:func:`summarize`): ``path[(rank, phase)]`` sums the path's seconds; the *typical* time of a
(rank, phase) is the median over the other ranks of the seconds each *worked* in that phase in
that step (waits taken out; for ``communication``, the seconds each was blocked); and the
step's **critical rank and phase** are the pair whose path time exceeds its typical time most:
where this step's time went beyond what the other ranks spend anyway. ``excess`` is that
difference; ``waited`` is how long each rank was blocked while the step's stretch of the path
ran (so a delay late in a step, in its optimizer phase, is charged to that step although the
others wait for it at the next step's first collective).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from phalanx.diagnostics.events import Op, RankTimeline

__all__ = [
    "COMMUNICATION",
    "CriticalPath",
    "Jump",
    "PathPiece",
    "StepCritical",
    "critical_path",
    "summarize",
    "walk",
]

COMMUNICATION = "communication"
"""The phase of a path stretch spent in a transfer nobody else held up."""
RELEASE_SLACK_S = 2e-3
"""An operation's end is noted just after the wait it ended (another clock read, or the
completing thread): operations ending this long after a wait still count as releasing it."""


@dataclass(frozen=True)
class PathPiece:
    """A stretch of one rank's time on the critical path."""

    rank: int
    start: float
    end: float
    phase: str
    step: int | None


@dataclass(frozen=True)
class Jump:
    """Where the path moved: ``rank`` waited from ``wait_start`` until ``released`` for
    ``to_rank``, which arrived at ``at`` at the operation ``key``."""

    rank: int
    to_rank: int
    at: float
    wait_start: float
    released: float
    key: str


@dataclass
class StepCritical:
    """The critical path of one step (see the module's docstring)."""

    step: int
    rank: int
    phase: str
    excess: float
    """Seconds the critical (rank, phase) spent on the path beyond the typical rank's time."""
    on_path: float
    """Seconds the critical (rank, phase) spent on the path."""
    start: float
    """When this step's stretch of the critical path begins (rank 0's clock)."""
    end: float
    """When it ends."""
    path: dict[tuple[int, str], float] = field(default_factory=dict)
    """Seconds on the path per (rank, phase)."""
    waited: dict[int, float] = field(default_factory=dict)
    """Seconds each rank was blocked between ``start`` and ``end``."""

    @property
    def others_waited(self) -> float:
        """The mean of the other ranks' blocked seconds while this step's path ran."""
        others = [w for r, w in self.waited.items() if r != self.rank]
        return statistics.fmean(others) if others else 0.0


@dataclass
class CriticalPath:
    """The whole run's path, and each step's verdict."""

    pieces: list[PathPiece]
    """Newest first."""
    jumps: list[Jump]
    steps: list[StepCritical]


def critical_path(ranks: dict[int, RankTimeline]) -> CriticalPath:
    """Walk the run's critical path and judge each step."""
    pieces, jumps = walk(ranks)
    return CriticalPath(pieces, jumps, summarize(ranks, pieces))


def walk(ranks: dict[int, RankTimeline]) -> tuple[list[PathPiece], list[Jump]]:
    """The critical path from the end of the run back to its start: pieces, newest first, and
    the jumps between ranks."""
    started = [tl for tl in ranks.values() if tl.segments]
    if not started:
        return [], []
    tl = max(started, key=lambda x: x.end)
    t = tl.end
    pieces: list[PathPiece] = []
    jumps: list[Jump] = []
    while True:
        wait = tl.wait_at(t)
        if wait is not None:
            cause = _released_by(tl, wait, t)
            if cause is not None and cause.last_rank in ranks:
                assert cause.last_rank is not None and cause.last_start is not None
                jumps.append(
                    Jump(tl.rank, cause.last_rank, cause.last_start, wait[0], t, cause.key)
                )
                tl, t = ranks[cause.last_rank], cause.last_start
                continue
            seg = tl.segment_at(t)
            pieces.append(PathPiece(tl.rank, wait[0], t, COMMUNICATION, seg.step if seg else None))
            t = wait[0]
            continue
        seg = tl.segment_at(t)
        if seg is None:
            return pieces, jumps
        lo = max(seg.start, tl.wait_end_before(t))
        pieces.append(PathPiece(tl.rank, lo, t, seg.phase, seg.step))
        t = lo


def _released_by(tl: RankTimeline, wait: tuple[float, float], t: float) -> Op | None:
    """The operation whose last arrival ended ``wait`` (this rank blocked there at ``t``), if
    another rank arrived last and after the wait began."""
    start, end = wait
    found: Op | None = None
    for op in tl.ops_ending(start, end + RELEASE_SLACK_S):
        if op.idle or op.last_start is None or op.start > end:
            continue
        if start < op.last_start < t and (found is None or op.last_start > _last(found)):
            found = op
    if found is None or found.last_rank == tl.rank:
        return None
    return found


def _last(op: Op) -> float:
    assert op.last_start is not None
    return op.last_start


def summarize(ranks: dict[int, RankTimeline], pieces: list[PathPiece]) -> list[StepCritical]:
    """Each step's critical rank and phase (see the module's docstring), in step order."""
    by_step: dict[int, list[PathPiece]] = defaultdict(list)
    for piece in pieces:
        if piece.step is not None:
            by_step[piece.step].append(piece)
    work = {rank: _work(tl) for rank, tl in ranks.items()}
    out = []
    for step, on in sorted(by_step.items()):
        path: dict[tuple[int, str], float] = defaultdict(float)
        for piece in on:
            path[(piece.rank, piece.phase)] += piece.end - piece.start
        in_step = {r: w[step] for r, w in work.items() if step in w}
        excess = {key: spent - _typical(in_step, *key) for key, spent in path.items()}
        rank, phase = max(excess, key=lambda k: excess[k])
        start, end = min(p.start for p in on), max(p.end for p in on)
        waited = {r: tl.waited(start, end) for r, tl in ranks.items() if tl.segments}
        top = (rank, phase)
        out.append(StepCritical(step, rank, phase, excess[top], path[top], start, end))
        out[-1].path, out[-1].waited = dict(path), waited
    return out


def _typical(in_step: dict[int, dict[str, float]], rank: int, phase: str) -> float:
    """The median of the other ranks' seconds in ``phase`` this step (0: no other rank)."""
    others = [w.get(phase, 0.0) for r, w in in_step.items() if r != rank]
    return statistics.median(others) if others else 0.0


def _work(tl: RankTimeline) -> dict[int, dict[str, float]]:
    """Per step: seconds worked per phase, and seconds blocked (as ``communication``)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for seg in tl.segments:
        if seg.step is None:
            continue
        blocked = tl.waited(seg.start, seg.end)
        per = out[seg.step]
        per[seg.phase] += seg.end - seg.start - blocked
        per[COMMUNICATION] += blocked
    return out
