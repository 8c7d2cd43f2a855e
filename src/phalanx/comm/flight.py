"""The flight recorder: this rank's recent collectives, and where ranks' records diverge.

Every collective issued through :mod:`phalanx.comm.collectives` leaves a :class:`Record`
(group, sequence number, op, shape, call site, start and end time) in a fixed-size ring, so a
hang or a crash can say what each rank was doing without any cost beyond appending a tuple.
Point-to-point operations (:mod:`phalanx.comm.p2p`) leave records too, on their own channel
(group ``p2p``, with the ``peer``): they are shown in reports but never lined up across ranks.
:func:`first_divergence` (pure) lines up several ranks' records by group and sequence number
and finds the first collective the ranks disagree on: a different op, shape or call site at the
same position (ranks on different code paths, e.g. an all-reduce inside ``if rank == 0:``), or
a position some ranks reached and others never did.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Divergence", "FlightRecorder", "Record", "first_divergence", "load_dump"]

CAPACITY = 256


@dataclass
class Record:
    """One collective as this rank issued it."""

    group: str
    seq: int
    op: str
    shape: str
    site: str
    """``file:line in function`` of the first caller outside phalanx.comm and torch."""
    start: float
    """``time.time()`` when the rank entered it."""
    end: float | None = None
    """When it completed (None: still in flight, or an async op never waited on)."""
    peer: int | None = None
    """Point-to-point only: the other global rank (-1: a receive from any rank). A P2P record
    starts when this rank begins to wait for the operation, not when it was posted."""
    idle: bool = False
    """A wait that is expected to be long (a server waiting for its next request): recorded,
    never reported as a hang."""

    def where(self) -> str:
        """``all_reduce [4, 2] at train.py:12 in step`` (``recv [4] from rank 0 at ...``)."""
        return f"{self.op} {self.shape}{self.peer_text()} at {self.site}"

    def peer_text(self) -> str:
        """`` from rank 0`` / `` to rank 1`` / `` from any rank`` (empty for a collective)."""
        if self.peer is None:
            return ""
        side = {"send": "to", "recv": "from"}.get(self.op, "with")
        return f" {side} any rank" if self.peer < 0 else f" {side} rank {self.peer}"


class FlightRecorder:
    """A ring of the last ``capacity`` records; safe to read from a watchdog thread."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._ring: deque[Record] = deque(maxlen=capacity)
        self._open: dict[tuple[str, int], Record] = {}
        self._lock = threading.Lock()

    def start(
        self,
        group: str,
        seq: int,
        op: str,
        shape: str,
        site: str,
        *,
        peer: int | None = None,
        idle: bool = False,
    ) -> None:
        """Record that this rank entered collective ``seq`` of ``group`` (or P2P, with ``peer``)."""
        rec = Record(group, seq, op, shape, site, time.time(), peer=peer, idle=idle)
        with self._lock:
            self._ring.append(rec)
            self._open[(group, seq)] = rec
            if len(self._open) > 4 * CAPACITY:  # async works nobody waits on: forget them
                self._open.pop(next(iter(self._open)))

    def finish(self, group: str, seq: int) -> None:
        """Record that collective ``seq`` of ``group`` completed on this rank."""
        with self._lock:
            rec = self._open.pop((group, seq), None)
        if rec is not None:
            rec.end = time.time()

    def forget_in_flight(self) -> None:
        """Stop watching every open record (its process group is gone: it can never complete).

        The records stay in the ring, without an end."""
        with self._lock:
            self._open.clear()

    def in_flight(self) -> Record | None:
        """The oldest operation that entered and has not completed, if any (idle waits aside)."""
        with self._lock:
            waiting = (r for r in self._open.values() if not r.idle)
            return min(waiting, key=lambda r: r.start, default=None)

    def records(self) -> list[Record]:
        """The ring, oldest first (copies)."""
        with self._lock:
            return [Record(**asdict(r)) for r in self._ring]

    def dump(self, path: str | os.PathLike[str], rank: int, **extra: Any) -> None:
        """Write the ring (and ``extra``) as JSON to ``path``, atomically."""
        doc = {"rank": rank, "records": [asdict(r) for r in self.records()], **extra}
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def load_dump(path: str | os.PathLike[str]) -> tuple[int, list[Record]]:
    """Read one rank's :meth:`FlightRecorder.dump`."""
    doc = json.loads(Path(path).read_text())
    return int(doc["rank"]), [Record(**r) for r in doc["records"]]


@dataclass(frozen=True)
class Divergence:
    """The first collective the ranks disagree on."""

    group: str
    seq: int
    issued: dict[int, Record]
    """Rank -> what it issued at that position."""
    missing: tuple[int, ...]
    """Ranks whose records stop before this position."""

    def describe(self) -> str:
        """Which ranks did what, with call sites."""
        by_where: dict[str, list[int]] = {}
        for rank, rec in sorted(self.issued.items()):
            by_where.setdefault(rec.where(), []).append(rank)
        parts = [f"rank(s) {ranks} issued {where}" for where, ranks in by_where.items()]
        if self.missing:
            parts.append(f"rank(s) {list(self.missing)} never issued it")
        return f"collective #{self.seq} on group {self.group} diverges: " + "; ".join(parts)


def _key(rec: Record) -> tuple[str, str, str]:
    return rec.op, rec.shape, rec.site


def first_divergence(records: Mapping[int, Sequence[Record]]) -> Divergence | None:
    """The first (group, seq) where the ranks' records differ or some ranks stop; else None.

    Only positions every rank could still hold in its ring are compared (a ring forgets its
    oldest records). Among groups, the divergence that started earliest in time is returned.
    Point-to-point records are left out: a send and its receive differ by design.
    """
    records = {rank: [r for r in recs if r.peer is None] for rank, recs in records.items()}
    found: list[tuple[float, Divergence]] = []
    groups = {r.group for recs in records.values() for r in recs}
    for group in sorted(groups):
        by_rank = {
            rank: {r.seq: r for r in recs if r.group == group} for rank, recs in records.items()
        }
        members = {rank: seqs for rank, seqs in by_rank.items() if seqs}
        if len(members) < 2:
            continue
        lowest = max(min(seqs) for seqs in members.values())
        highest = max(max(seqs) for seqs in members.values())
        for seq in range(lowest, highest + 1):
            issued = {rank: seqs[seq] for rank, seqs in members.items() if seq in seqs}
            missing = tuple(sorted(rank for rank in members if seq not in members[rank]))
            if missing or len({_key(r) for r in issued.values()}) > 1:
                first = min(r.start for r in issued.values())
                found.append((first, Divergence(group, seq, issued, missing)))
                break
    return min(found, key=lambda f: f[0])[1] if found else None
