"""Live hang reports: one incident per hang, one text that every rank prints.

Runs on each rank's progress thread (every 0.5 s, see :mod:`.tracking`). When this rank's oldest
in-flight collective has waited longer than ``PHALANX_HANG_TIMEOUT`` seconds (default 60) it
opens an *incident*: the first rank to write ``hang/incident/<n>`` (an atomic compare-and-set
of a signed value, :meth:`~phalanx.comm.signed.SignedStore.first`) is its opener; a rank that
finds its own collective stuck while incident n is open joins it instead of opening another.
Every rank sees the incident on its next tick and answers once, with its in-flight record, its
main thread's stack and the tail of its flight record. The opener collects the answers (until
every rank has answered or, for ranks that look dead or stuck holding the GIL, ``COLLECT_S``),
reads the silent ranks' files on its host (:mod:`.rank_files`: a faulthandler stack, the call
ring, whether the process lives; for another machine none of whose ranks answered, that the
network link to it may be down), builds the report (:mod:`.hang_report`) and publishes it;
every rank prints exactly that text to stderr while the job is still alive (so the launcher
shows it too). A stuck send or receive (:mod:`phalanx.comm.p2p` says which waits are watched)
names its peer. A rank builds the report itself only if the opener's never comes. With
``PHALANX_DUMP_DIR`` each rank also writes its flight record there for ``phalanx diagnose DIR``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any

from phalanx.comm.flags import hang_timeout
from phalanx.comm.signed import SignedStore, as_record
from phalanx.diagnostics.flight import FlightRecorder, Record
from phalanx.diagnostics.hang_report import Answer, Incident, Silent, build_report
from phalanx.diagnostics.rank_files import Peer, peers

__all__ = ["Watchdog", "dump_on_failure"]

TAIL = 64
COLLECT_S = 1.2
"""Answers come within a tick (0.5 s); a rank that looks stuck or dead is not waited longer."""
MAX_COLLECT_S = 3.0
"""A silent rank that looks healthy (or cannot be seen from here) is waited for this long."""
REPORT_WAIT_S = MAX_COLLECT_S + 1.5
POLL_S = 0.05


def dump_on_failure(recorder: FlightRecorder, rank: int) -> None:
    """Write this rank's flight record to ``PHALANX_DUMP_DIR`` (if set) after a failure."""
    where = os.environ.get("PHALANX_DUMP_DIR")
    if where:
        os.makedirs(where, exist_ok=True)
        recorder.dump(os.path.join(where, f"rank-{rank}.json"), rank)


def _main_stack() -> list[str]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return [] if frame is None else traceback.format_stack(frame)


def _record_or_none(value: Any) -> Record | None:
    return None if value is None else as_record(Record, value)


def _incident(value: Any) -> Incident:
    n, opener, at = value["n"], value["opener"], value["at"]
    if not (isinstance(n, int) and isinstance(opener, int) and isinstance(at, int | float)):
        raise TypeError("an incident is {n, opener, at, stuck}")
    return Incident(n, opener, float(at), as_record(Record, value["stuck"]))


def _answer(value: Any) -> Answer:
    stack, records, at = value["stack"], value["records"], value["at"]
    if not (isinstance(stack, list) and all(isinstance(x, str) for x in stack)):
        raise TypeError("a stack is a list of strings")
    if not (isinstance(records, list) and isinstance(at, int | float)):
        raise TypeError("an answer is {at, in_flight, stack, records}")
    host = value.get("host", "")
    if not isinstance(host, str):
        raise TypeError("an answer's host is a string")
    recs = [as_record(Record, r) for r in records]
    return Answer(float(at), _record_or_none(value["in_flight"]), stack, recs, host)


def _report(value: Any) -> str:
    if not (isinstance(value, dict) and isinstance(value.get("text"), str)):
        raise TypeError("a report is {text}")
    return str(value["text"])


def silent_rank(rank: int, peer: Peer | None) -> Silent:
    """What this host can say about a rank that did not answer."""
    if peer is None:
        return Silent([f"rank {rank} did not answer and never published where it runs."])
    at = f"{peer.host}, {peer.addr}" if peer.addr else peer.host
    who = f"rank {rank} (host {at}, pid {peer.pid})"
    elsewhere = (peer.host, peer.addr) if peer.elsewhere() else None
    if not peer.dir:
        return Silent(
            [f"{who} did not answer (dead, or stuck holding the GIL); it has no rank files."],
            elsewhere=elsewhere,
        )
    if not peer.here():
        return Silent(
            [
                f"{who} did not answer (dead, or stuck holding the GIL); faulthandler writes "
                f"its stacks to {peer.where('stuck')} (stuck) and {peer.where('fatal')} (fatal)."
            ],
            elsewhere=elsewhere,
        )
    calls, death = peer.calls(), peer.death()
    if not peer.alive():
        sig = death[0] if death else None
        how = f"killed by {sig}" if sig else "without a fatal-signal record (SIGKILL or exit)"
        return Silent([f"{who} is dead, {how}."], calls, death[1] if death else [])
    stuck = peer.stuck()
    if stuck is not None:
        line = (
            f"{who} did not answer: its progress thread has not run for a second or more "
            f"(the GIL is held, e.g. by a native call)."
        )
        return Silent([line], calls, stuck)
    return Silent([f"{who} did not answer in time, though it lives and is not stuck."], calls)


class Watchdog:
    """One rank's hang detector and report writer.

    Store keys (signed, see :mod:`phalanx.comm.signed`): ``hang/incident/<n>`` the incident,
    ``hang/answer/<n>/<r>`` each rank's answer, ``hang/report/<n>`` the published text.
    """

    def __init__(
        self,
        recorder: FlightRecorder,
        rank: int,
        world_size: int,
        timeout_s: float | None = None,
    ) -> None:
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.timeout = hang_timeout() if timeout_s is None else timeout_s
        """Seconds a collective waits before it is a hang (default ``PHALANX_HANG_TIMEOUT``)."""
        self.next = 1
        """The number of the next incident this rank has not seen."""
        self._covered: set[tuple[str, int]] = set()
        self.reports: list[str] = []
        """Reports this rank printed (for tests and tools)."""
        self.printed: list[float] = []
        """When it printed each (``time.time()``)."""

    def tick(self, store: SignedStore) -> None:
        """Answer incidents others opened; open (or join) one if this rank is stuck."""
        while self._poll(store):
            pass
        stuck = self.recorder.in_flight()
        if stuck is None or (stuck.group, stuck.seq) in self._covered:
            return
        now = time.time()
        if now - stuck.start > self.timeout:
            mine = {"n": self.next, "opener": self.rank, "at": now, "stuck": asdict(stuck)}
            self._handle(store, store.first(f"hang/incident/{self.next}", mine, _incident))

    def _poll(self, store: SignedStore) -> bool:
        inc = store.get(f"hang/incident/{self.next}", _incident)
        if inc is None:
            return False
        if store.get(f"hang/report/{inc.n}", _report) is not None:
            self.next = inc.n + 1  # closed while this rank could not look (e.g. GIL held)
        else:
            self._handle(store, inc)
        return True

    def _handle(self, store: SignedStore, inc: Incident) -> None:
        self.next = inc.n + 1
        stuck = self.recorder.in_flight()
        if stuck is not None:
            self._covered.add((stuck.group, stuck.seq))
        mine = {
            "at": time.time(),
            "in_flight": None if stuck is None else asdict(stuck),
            "stack": _main_stack(),
            "records": [asdict(r) for r in self.recorder.records()[-TAIL:]],
            "host": socket.gethostname(),
        }
        store.put(f"hang/answer/{inc.n}/{self.rank}", mine)
        dump_on_failure(self.recorder, self.rank)
        if inc.opener == self.rank:
            text = build_report(inc, *self._collect(store, inc))
            store.put(f"hang/report/{inc.n}", {"text": text})
        else:
            text = self._published(store, inc)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        self.reports.append(text)
        self.printed.append(time.time())

    def _collect(
        self, store: SignedStore, inc: Incident
    ) -> tuple[dict[int, Answer], dict[int, Silent]]:
        start = time.monotonic()
        answers: dict[int, Answer] = {}
        known: dict[int, Peer] = {}
        while True:
            for r in sorted(set(range(self.world_size)) - set(answers)):
                answer = store.get(f"hang/answer/{inc.n}/{r}", _answer)
                if answer is not None:
                    answers[r] = answer
            missing = sorted(set(range(self.world_size)) - set(answers))
            waited = time.monotonic() - start
            if not missing or waited >= MAX_COLLECT_S:
                break
            if waited >= COLLECT_S:
                known.update(peers(store, [r for r in missing if r not in known]))
                if not any(self._healthy(known.get(r)) for r in missing):
                    break
            time.sleep(POLL_S)
        known.update(peers(store, [r for r in missing if r not in known]))
        return answers, {r: silent_rank(r, known.get(r)) for r in missing}

    @staticmethod
    def _healthy(peer: Peer | None) -> bool:
        """Worth waiting for: not visibly dead or stuck (or not visible from here)."""
        if peer is None or not peer.here():
            return True
        return bool(peer.alive()) and peer.stuck() is None

    def _published(self, store: SignedStore, inc: Incident) -> str:
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline:
            text = store.get(f"hang/report/{inc.n}", _report)
            if text is not None:
                return text
            time.sleep(POLL_S)
        answers, silent = self._collect(store, inc)
        return (
            build_report(inc, answers, silent)
            + f"\n(rank {inc.opener}, which opened this incident, published no report within "
            f"{REPORT_WAIT_S:.1f} s; rank {self.rank} built this one from the answers it found)"
        )
