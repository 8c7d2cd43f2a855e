"""Agreeing on a generation's membership through the store, without a leader.

Generation ``k`` is agreed in two phases, both polled with deadlines (``poll`` = 10 ms):

1. **Membership.** Every member of the base (generation ``k - 1``) that is still alive writes
   ``g<k>/here/<slot>``. As soon as one of them sees every base member either *here* or
   *dead* (a death record covers its incarnation), it proposes "here and not dead" with a
   compare-and-set on ``g<k>/members``: the first proposal wins and every member adopts it, so
   survivors that detected the failure at different moments still agree on one set. A member
   that neither arrives nor is recorded dead is declared dead when its heartbeat has not moved
   for ``heartbeat_timeout`` or when it has not arrived within ``arrival_timeout`` (it hangs).
   Growth is the same key written by the group's rank 0 with the joiners added, before it says
   *here* itself, so nobody proposes without it unless it died.
2. **Readiness.** Every member of the agreed list writes ``g<k>/ready/<slot>`` and waits until
   all have; a death meanwhile abandons ``k`` (everyone moves to ``k + 1`` with the agreed list
   as base), so a failure during recovery never splits the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.comm.signed import SignedStore
from phalanx.recovery.errors import PeerLost
from phalanx.recovery.heartbeat import StaleWatch
from phalanx.recovery.keys import _as_incarnation, dead_key, report_death
from phalanx.recovery.membership import Member, is_dead, parse_members, survivors

__all__ = ["Board", "Readiness"]

POLL_S = 0.01
log = logging.getLogger(__name__)


def members_key(k: int) -> str:
    """Key of generation ``k``'s agreed membership."""
    return f"g{k}/members"


def _as_json(members: Sequence[Member]) -> list[list[object]]:
    return [m.to_json() for m in members]


@dataclass(frozen=True)
class Readiness:
    """The outcome of the readiness phase of one generation."""

    failed: list[Member]
    """Members that died or were declared dead meanwhile (any: the generation is abandoned)."""
    fresh: list[Member]
    """Members without the training state (replacements that have not received it yet)."""


@dataclass(frozen=True)
class Board:
    """The live-recovery keys of one job, as one member reads and writes them."""

    live: SignedStore
    me: Member
    heartbeat_timeout: float
    arrival_timeout: float

    def dead(self, members: Sequence[Member]) -> dict[str, int]:
        """The death records of ``members``' slots (absent slots are missing)."""
        out = {}
        for m in members:
            died = self.live.get(dead_key(m.member_id), _as_incarnation)
            if died is not None:
                out[m.member_id] = died
        return out

    def check_alive(self, members: Sequence[Member], where: str) -> None:
        """Raise :class:`PeerLost` when one of ``members`` is recorded dead (``where``: who
        asks, for the message)."""
        dead = self.dead(members)
        lost = [m for m in members if is_dead(m, dead)]
        if lost:
            raise PeerLost(
                f"{where}: {', '.join(map(str, lost))} died; recover() forms the next generation"
            )

    def _arrived(self, k: int, members: Sequence[Member]) -> list[Member]:
        return [m for m in members if self.live.get(f"g{k}/here/{m.member_id}") == m.incarnation]

    def _readiness(self, k: int, members: Sequence[Member]) -> dict[Member, bool]:
        """Per member of ``members`` that said ready for ``k``: whether it holds the state."""
        out: dict[Member, bool] = {}
        for m in members:
            said = self.live.get(f"g{k}/ready/{m.member_id}")
            if isinstance(said, dict) and said.get("incarnation") == m.incarnation:
                out[m] = said.get("stateful") is True
        return out

    def declare_dead(self, member: Member, why: str) -> None:
        """Record ``member`` dead (every survivor then drops it); log why."""
        log.warning("member %s declared dead by member %s: %s", member, self.me, why)
        report_death(self.live, member.member_id, member.incarnation)

    def agree(
        self, k: int, base: Sequence[Member], proposal: Sequence[Member] | None
    ) -> list[Member]:
        """Generation ``k``'s membership; ``proposal`` is rank 0's growth list (None: recovery)."""
        agreed = None
        if proposal is not None:
            agreed = self.live.first(members_key(k), _as_json(proposal), parse_members)
        self.live.put(f"g{k}/here/{self.me.member_id}", self.me.incarnation)
        watch, late = (
            StaleWatch(self.live, self.heartbeat_timeout),
            time.monotonic() + self.arrival_timeout,
        )
        while agreed is None:
            agreed = self.live.get(members_key(k), parse_members)
            if agreed is not None:
                break
            dead, here = self.dead(base), self._arrived(k, base)
            missing = [m for m in base if m not in here and not is_dead(m, dead)]
            if not missing:
                offer = _as_json(survivors(base, here, dead))
                agreed = self.live.first(members_key(k), offer, parse_members)
                break
            self._expire(watch, missing, late, f"it did not reach generation {k}'s agreement")
            time.sleep(POLL_S)
        return agreed

    def ready(self, k: int, agreed: Sequence[Member], stateful: bool) -> Readiness:
        """Say ready for generation ``k`` (``stateful``: holds the training state); wait for all."""
        said = {"incarnation": self.me.incarnation, "stateful": stateful}
        self.live.put(f"g{k}/ready/{self.me.member_id}", said)
        watch, late = (
            StaleWatch(self.live, self.heartbeat_timeout),
            time.monotonic() + self.arrival_timeout,
        )
        while True:
            dead = self.dead(agreed)
            failed = [m for m in agreed if is_dead(m, dead)]
            if failed:
                return Readiness(failed, [])
            readiness = self._readiness(k, agreed)
            waiting = [m for m in agreed if m not in readiness]
            if not waiting:
                return Readiness([], [m for m in agreed if not readiness[m]])
            self._expire(watch, waiting, late, f"it did not get ready for generation {k}")
            time.sleep(POLL_S)

    def _expire(self, watch: StaleWatch, waiting: list[Member], late: float, why: str) -> None:
        for m in watch.stale(waiting):
            self.declare_dead(m, f"its heartbeat did not move for {self.heartbeat_timeout:g} s")
        if time.monotonic() > late:
            for m in waiting:
                self.declare_dead(m, f"{why} within {self.arrival_timeout:g} s")
