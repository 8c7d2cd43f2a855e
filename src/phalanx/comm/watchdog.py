"""Live hang reports: which ranks have not reached a stuck collective, and what they are doing.

Runs on each rank's progress thread (every 0.5 s, see :mod:`.tracking`). When this rank's oldest
in-flight collective has waited longer than ``PHALANX_HANG_TIMEOUT`` seconds (default 60) it
raises a signed request in the store. Every rank's watchdog sees the request on its next tick and
publishes its Python stacks and the tail of its flight record; each then collects everyone's,
and prints one report to stderr (so the launcher, which forwards the ranks' output, shows it
too) while the ranks are still alive. The report names the collective, the ranks that never
reached it with their last completed collective and their main thread's stack, and the first
collective where the ranks' records diverge (a different call site at the same position: ranks
on different code paths). A stuck send or receive (:mod:`.p2p` says which waits are watched)
names its peer and shows the peer's stack. With ``PHALANX_DUMP_DIR`` each rank also writes its
flight record there for ``phalanx diagnose DIR``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any

from phalanx.comm.flight import FlightRecorder, Record, first_divergence
from phalanx.comm.signed import SignedStore, as_record

__all__ = ["Watchdog", "dump_on_failure", "hang_timeout"]

TAIL = 64
COLLECT_S = 3.0


def hang_timeout() -> float:
    """``PHALANX_HANG_TIMEOUT`` seconds (default 60); a malformed value is named."""
    raw = os.environ.get("PHALANX_HANG_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"PHALANX_HANG_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"PHALANX_HANG_TIMEOUT={raw!r} must be > 0 seconds")
    return value


def dump_on_failure(recorder: FlightRecorder, rank: int) -> None:
    """Write this rank's flight record to ``PHALANX_DUMP_DIR`` (if set) after a failure."""
    where = os.environ.get("PHALANX_DUMP_DIR")
    if where:
        os.makedirs(where, exist_ok=True)
        recorder.dump(os.path.join(where, f"rank-{rank}.json"), rank)


def _main_stack() -> list[str]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return [] if frame is None else traceback.format_stack(frame)


def _request(value: Any) -> tuple[int, Record]:
    """A hang request: ``{"n": its number for the requester, "stuck": the Record}``."""
    n = value["n"]
    if not isinstance(n, int) or n < 1:
        raise TypeError(f"a hang request number is a positive integer, got {n!r}")
    return n, as_record(Record, value["stuck"])


def _state(value: Any) -> dict[str, Any]:
    """One rank's answer: its main thread's stack and its last flight records."""
    stack, records = value["stack"], value["records"]
    if not (isinstance(stack, list) and all(isinstance(x, str) for x in stack)):
        raise TypeError("a stack is a list of strings")
    if not isinstance(records, list):
        raise TypeError("records are a list")
    return {"stack": stack, "records": [as_record(Record, r) for r in records]}


class Watchdog:
    """One rank's hang detector and report writer.

    Store keys (signed, see :mod:`.signed`): ``hang/req/<r>`` holds rank r's latest request
    with its number; ``hang/<r>/<n>/<rank>`` each rank's answer to it. ``hang/bell`` is a
    counter that only says "look at the requests": a stranger who rings it costs one scan.
    """

    def __init__(self, recorder: FlightRecorder, rank: int, world_size: int) -> None:
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.timeout = hang_timeout()
        self._requested: set[tuple[str, int]] = set()
        self._asked = 0
        self._bell = 0
        self._answered: dict[int, int] = {}
        """Per requester, the number of the last request this rank answered."""
        self.reports: list[str] = []
        """Reports this rank printed (for tests and tools)."""

    def tick(self, store: SignedStore) -> None:
        """Detect this rank's stuck collective; answer and report other ranks' requests."""
        stuck = self.recorder.in_flight()
        if stuck is not None and time.time() - stuck.start > self.timeout:
            key = (stuck.group, stuck.seq)
            if key not in self._requested:
                self._requested.add(key)
                self._asked += 1
                store.put(f"hang/req/{self.rank}", {"n": self._asked, "stuck": asdict(stuck)})
                store.bump("hang/bell", 1)
        bell = store.bump("hang/bell", 0)
        if bell != self._bell:
            self._bell = bell
            for requester in range(self.world_size):
                request = store.get(f"hang/req/{requester}", _request)
                if request is not None and request[0] > self._answered.get(requester, 0):
                    self._answered[requester] = request[0]
                    self._answer(store, requester, *request)

    def _answer(self, store: SignedStore, requester: int, n: int, stuck: Record) -> None:
        mine = {
            "stack": _main_stack(),
            "records": [asdict(r) for r in self.recorder.records()[-TAIL:]],
        }
        base = f"hang/{requester}/{n}"
        store.put(f"{base}/{self.rank}", mine)
        dump_on_failure(self.recorder, self.rank)
        states: dict[int, dict[str, Any]] = {}
        deadline = time.time() + COLLECT_S
        while True:
            for r in set(range(self.world_size)) - set(states):
                state = store.get(f"{base}/{r}", _state)
                if state is not None:
                    states[r] = state
            if len(states) == self.world_size or time.time() >= deadline:
                break
            time.sleep(0.05)
        report = build_report(self.rank, requester, stuck, states, self.world_size)
        self.reports.append(report)
        sys.stderr.write(report + "\n")
        sys.stderr.flush()


def build_report(
    me: int, requester: int, stuck: Record, states: dict[int, dict[str, Any]], world_size: int
) -> str:
    """The hang report text from every rank's published state (pure)."""
    waited = time.time() - stuck.start
    records: dict[int, list[Record]] = {r: st["records"] for r, st in states.items()}
    kind = "collective" if stuck.peer is None else "point-to-point operation"
    lines = [
        f"phalanx hang report (printed by rank {me}): rank {requester} has waited "
        f"{waited:.0f} s in {stuck.where()} ({kind} #{stuck.seq} on group {stuck.group})."
    ]
    if stuck.peer is None:
        behind = [
            r
            for r, recs in records.items()
            if not any(x.group == stuck.group and x.seq >= stuck.seq for x in recs)
        ]
    else:  # the peer never posted the matching send or receive
        behind = [r for r in records if r == stuck.peer or (stuck.peer < 0 and r != requester)]
        lines.append(f"It waits for rank(s) {behind} to post the matching operation.")
    silent = sorted(set(range(world_size)) - set(states))
    if behind and stuck.peer is None:
        lines.append(f"Rank(s) {behind} never reached it.")
    if silent:
        lines.append(f"Rank(s) {silent} did not answer (dead, or stuck holding the GIL).")
    # A collective's laggard: its last collective; a P2P peer: its last operation with the waiter.
    what = "collective" if stuck.peer is None else f"operation with rank {requester}"
    for r in behind:
        done = [
            x
            for x in records[r]
            if x.end is not None and (x.peer is None if stuck.peer is None else x.peer == requester)
        ]
        last = f"{done[-1].where()} (#{done[-1].seq})" if done else "none"
        lines.append(f"rank {r}: last completed {what}: {last}")
        lines.append(f"rank {r} main thread stack (most recent call last):")
        lines.extend("  " + ln.rstrip() for ln in "".join(states[r]["stack"]).splitlines())
    div = first_divergence(records)
    if div is not None and (div.group, div.seq) == (stuck.group, stuck.seq) and div.missing:
        div = None  # only the stuck collective itself, already described above
    if div is not None:
        lines.append("First divergence: " + div.describe())
    return "\n".join(lines)
