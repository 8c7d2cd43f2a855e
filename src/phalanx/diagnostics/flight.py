"""The flight recorder: this rank's recent collectives, and where ranks' records diverge.

Every collective issued through :mod:`phalanx.comm.collectives` leaves a :class:`Record`
(group, sequence number, op, shape, reduce op and root, call site, start and end time) in a
fixed-size ring, so a hang or a crash can say what each rank was doing without any cost beyond
appending a tuple. Point-to-point operations (:mod:`phalanx.comm.p2p`) leave records too, on
their own channel (group ``p2p``, with the ``peer``): they are shown in reports but never lined
up across ranks. Where several ranks' records diverge is :mod:`.pairing`'s business
(:func:`~phalanx.diagnostics.pairing.first_divergence`).

A tool that keeps every record (``phalanx.diagnostics``' timeline) adds a *sink*
(:meth:`FlightRecorder.add_sink`): each new record is handed to it as well, and its ``end`` is
filled in later, in place, when the operation completes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["FlightRecorder", "Record", "load_dump"]

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
    args: str = ""
    """The reduce op and root, e.g. ``SUM`` or ``root=0`` (empty when the op has neither)."""

    def where(self) -> str:
        """``all_reduce [4, 2] float32 SUM at t.py:12 in f`` (``recv [4] from rank 0 at ...``)."""
        args = f" {self.args}" if self.args else ""
        return f"{self.op} {self.shape}{args}{self.peer_text()} at {self.site}"

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
        self._sinks: tuple[Callable[[Record], None], ...] = ()

    def add_sink(self, sink: Callable[[Record], None]) -> None:
        """Hand every record started from now on to ``sink`` too (called on the thread that
        starts it: keep it to an append)."""
        self._sinks = (*self._sinks, sink)

    def remove_sink(self, sink: Callable[[Record], None]) -> None:
        """Stop handing records to ``sink`` (absent: nothing happens)."""
        self._sinks = tuple(s for s in self._sinks if s != sink)  # bound methods: equal, not same

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
        args: str = "",
    ) -> Record:
        """Record that this rank entered collective ``seq`` of ``group`` (or P2P, with ``peer``);
        returns the record."""
        rec = Record(group, seq, op, shape, site, time.time(), peer=peer, idle=idle, args=args)
        with self._lock:
            self._ring.append(rec)
            self._open[(group, seq)] = rec
            if len(self._open) > 4 * CAPACITY:  # async works nobody waits on: forget them
                self._open.pop(next(iter(self._open)))
        for sink in self._sinks:
            sink(rec)
        return rec

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

    def tail(self, group: str, n: int) -> list[Record]:
        """The last ``n`` records of ``group``, oldest first (shared, not copied: read only)."""
        out: list[Record] = []
        with self._lock:
            for rec in reversed(self._ring):
                if rec.group == group:
                    out.append(rec)
                    if len(out) == n:
                        break
        return out[::-1]

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
