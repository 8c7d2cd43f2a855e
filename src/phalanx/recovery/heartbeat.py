"""Heartbeats: the fallback failure detector for a peer that vanishes without a word.

The launcher reports every worker death it sees (``dead/<slot>``), but it cannot see a whole
node that disappears, or a process that hangs. Each member therefore runs one daemon thread that
counts its own heartbeat up every ``interval`` and watches *one* peer, its successor in rank
order (so the store sees O(world size) reads per interval, not O(world size²)). A heartbeat
that has not moved for ``timeout`` seconds, as measured by the observer's own monotonic clock
(clocks of different machines are never compared), makes the observer write that member's death
record, which every survivor then trusts.

Staleness is only *detection*: gloo cannot abort a collective from another thread, so a
survivor blocked in a collective with a vanished node still waits for its collective timeout;
its recovery then finds the death already recorded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.comm.signed import SignedStore
from phalanx.recovery.keys import report_death
from phalanx.recovery.membership import Member

__all__ = ["Heartbeat", "StaleWatch"]

log = logging.getLogger(__name__)


def hb_key(member_id: str) -> str:
    """Key of slot ``member_id``'s heartbeat (relative to ``phalanx/live/``)."""
    return f"hb/{member_id}"


def _beat_of(member: Member) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if not isinstance(value, dict) or value.get("incarnation") != member.incarnation:
            return -1  # another incarnation's beat says nothing about this one
        beat = value.get("beat")
        if not isinstance(beat, int):
            raise TypeError(f"a heartbeat's beat must be an int, got {beat!r}")
        return beat

    return parse


@dataclass
class StaleWatch:
    """Which of some members' heartbeats have not moved for ``timeout`` seconds (observer clock)."""

    live: SignedStore
    timeout: float
    seen: dict[Member, tuple[int | None, float]] = field(default_factory=dict)
    """Per member: the last beat read and when it last changed."""

    def stale(self, members: Sequence[Member]) -> list[Member]:
        """Read the heartbeats of ``members``; return those stale for ``timeout`` seconds.

        A member never seen beating counts from the first time this watch looked at it.
        """
        now, out = time.monotonic(), []
        for m in members:
            beat = self.live.get(hb_key(m.member_id), _beat_of(m))
            last, since = self.seen.get(m, (None, now))
            if m not in self.seen or beat != last:
                self.seen[m] = (beat, now)
            elif now - since >= self.timeout:
                out.append(m)
        return out


class Heartbeat:
    """A daemon thread: beat for ``me`` every ``interval`` s; report a stale successor dead.

    ``live`` must be a store connection of its own (a clone): a TCPStore client is one socket,
    not to be shared with the main thread's requests.
    """

    def __init__(
        self,
        live: SignedStore,
        me: Member,
        interval: float,
        timeout: float,
    ) -> None:
        self._live, self._me, self._interval = live, me, interval
        self._watch = StaleWatch(live, timeout)
        self._successor: Member | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-heartbeat", daemon=True)

    def start(self) -> None:
        """Beat once now (so peers see this member at once), then start the thread."""
        self._beat(0)
        self._thread.start()

    def watch(self, members: Sequence[Member]) -> None:
        """Watch the successor of this member in ``members`` (a new generation's, rank order)."""
        others = [m for m in members if m != self._me]
        if not others or self._me not in members:
            self._successor = None
            return
        i = members.index(self._me)
        self._successor = members[(i + 1) % len(members)]
        self._watch = StaleWatch(self._live, self._watch.timeout)

    def stop(self) -> None:
        """Stop beating (the member leaves); waits at most one interval."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1.0)

    def _beat(self, n: int) -> None:
        self._live.put(hb_key(self._me.member_id), {"incarnation": self._me.incarnation, "beat": n})

    def _run(self) -> None:
        n = 1
        while not self._stop.wait(self._interval):
            try:
                self._beat(n)
                successor = self._successor
                if successor is not None and self._watch.stale([successor]):
                    log.warning(
                        "member %s declared dead by member %s: no heartbeat for %g s",
                        successor,
                        self._me,
                        self._watch.timeout,
                    )
                    report_death(self._live, successor.member_id, successor.incarnation)
                    self._successor = None
            except Exception as exc:  # the store went away: the job is ending or lost
                log.warning("heartbeat of member %s stopped: %s", self._me, exc)
                return
            n += 1
