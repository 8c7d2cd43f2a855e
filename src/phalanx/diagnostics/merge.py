"""Merge the ranks' files into one run: rank 0's clock, phases per step, operations matched.

For each rank (:func:`merge_logs`, pure):

- every time goes through the rank's :class:`~.clock_math.ClockModel` onto rank 0's clock;
- its phase marks become :class:`~.events.Segment` s, each from one mark to the next (the first
  from the recorder's start: the job's set-up, as ``other``; the last to the rank's close),
  owned by the step whose end comes first after the segment starts;
- its waits and operations are kept as they are, aligned.

Across ranks, each operation learns which rank arrived last (:attr:`~.events.Op.last_rank`):
a collective is the same call on every rank of its group when group and sequence number match;
a send is paired with the receive of the same two ranks in the order each side waited for them
(a receive from any rank, and a batch of sends and receives coalesced into one work, stay
unpaired).
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from phalanx.diagnostics.clock_math import ClockModel
from phalanx.diagnostics.events import OTHER, Op, RankTimeline, Segment
from phalanx.diagnostics.rank_log import RankLog, find_rank_logs, read_rank_log

__all__ = ["Run", "clock_report", "load_run", "match_ops", "merge_logs"]


@dataclass
class Run:
    """Every rank's timeline of one job, on rank 0's clock."""

    ranks: dict[int, RankTimeline]
    world_size: int
    clocks: dict[int, ClockModel]

    @property
    def t0(self) -> float:
        """The earliest moment anything happened (the trace's zero)."""
        starts = [s.start for tl in self.ranks.values() for s in tl.segments[:1]]
        starts += [o.start for tl in self.ranks.values() for o in tl.ops[:1]]
        return min(starts, default=0.0)


def load_run(run: str | os.PathLike[str]) -> Run:
    """Read and merge the rank files of ``run`` (the timeline folder, or a folder holding it).

    Raises:
        FileNotFoundError: no rank files there.
    """
    paths = find_rank_logs(run)
    if not paths:
        raise FileNotFoundError(
            f"{run}: no rank*.timeline.jsonl files (record with Job(timeline_dir=...) or "
            f"phalanx run --timeline DIR)"
        )
    return merge_logs([read_rank_log(p) for p in paths])


def merge_logs(logs: list[RankLog]) -> Run:
    """The run the rank logs make (see the module's docstring)."""
    ranks, clocks = {}, {}
    for log in logs:
        clock = ClockModel(log.syncs)
        clocks[log.rank] = clock
        ranks[log.rank] = _timeline(log, clock)
    match_ops([op for tl in ranks.values() for op in tl.ops])
    world_size = max([log.world_size for log in logs] + [len(logs)])
    return Run(ranks, world_size, clocks)


def _timeline(log: RankLog, clock: ClockModel) -> RankTimeline:
    align = clock.align
    ops = [_aligned(op, clock, log.rank) for op in log.ops]
    waits = [(align(s), align(e)) for s, e in log.waits]
    marks = [(align(t), name) for t, name in log.marks]  # in order: a sort would move ties
    if marks and log.started and align(log.started) < marks[0][0]:
        marks.insert(0, (align(log.started), None))  # from the job's start: its set-up
    steps = sorted((align(t), n) for t, n in log.steps)
    last = [t for t, _ in marks] + [o.end or o.start for o in ops] + [e for _, e in waits]
    end = align(log.closed) if log.closed is not None else max(last, default=0.0)
    return RankTimeline(log.rank, log.host, _segments(marks, steps, end), waits, ops)


def _aligned(op: Op, clock: ClockModel, rank: int) -> Op:
    end = None if op.end is None else clock.align(op.end)
    return replace(op, start=clock.align(op.start), end=end, rank=rank)


def _segments(
    marks: list[tuple[float, str | None]], steps: list[tuple[float, int]], end: float
) -> list[Segment]:
    step_times = [t for t, _ in steps]
    out = []
    for i, (start, name) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else max(end, start)
        if stop <= start:
            continue
        k = bisect.bisect_right(step_times, start)  # the first step to end after it starts
        step = steps[k][1] if k < len(steps) else None
        out.append(Segment(start, stop, name or OTHER, step))
    return out


def match_ops(ops: list[Op]) -> None:
    """Set ``last_rank``, ``last_start`` and ``key`` of every operation that has a partner
    (each op's ``rank`` says who issued it)."""
    collectives: dict[tuple[str, int], list[Op]] = defaultdict(list)
    sends: dict[tuple[int, int], list[Op]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Op]] = defaultdict(list)
    for op in ops:
        rank = op.rank
        if op.peer is None:
            collectives[(op.group, op.seq)].append(op)
        elif op.peer >= 0 and op.op == "send":
            sends[(rank, op.peer)].append(op)
        elif op.peer >= 0 and op.op == "recv":
            recvs[(op.peer, rank)].append(op)
    for (group, seq), same in collectives.items():
        _set_last(same, f"{group}#{seq}")
    for pair, sent in sends.items():
        got = sorted(recvs.get(pair, []), key=lambda o: o.start)
        for n, (s, r) in enumerate(zip(sorted(sent, key=lambda o: o.start), got)):
            _set_last([s, r], f"p2p:{pair[0]}>{pair[1]}#{n}")


def _set_last(same: list[Op], key: str) -> None:
    last = max(same, key=lambda o: o.start)
    for op in same:
        op.last_rank, op.last_start, op.key = last.rank, last.start, key


def clock_report(run: Run) -> dict[str, Any]:
    """How well the clocks are aligned: per rank and overall, in milliseconds."""
    per_rank = {}
    for rank, clock in sorted(run.clocks.items()):
        samples = clock.samples
        per_rank[str(rank)] = {
            "samples": len(samples),
            "offset_ms": 1e3 * samples[-1].offset if samples else None,
            "error_ms": 1e3 * clock.error if samples else None,
            "drift_ms": 1e3 * clock.drift,
        }
    others = [c for r, c in run.clocks.items() if r != 0]
    measured = all(c.samples for c in others)
    return {
        "method": "NTP-style ping-pong with rank 0, shortest of several round trips; offsets "
        "interpolated linearly between measurements",
        "measured": measured,
        "max_error_ms": 1e3 * max((c.error for c in others), default=0.0) if measured else None,
        "max_drift_ms": 1e3 * max((c.drift for c in others), default=0.0),
        "ranks": per_rank,
    }
