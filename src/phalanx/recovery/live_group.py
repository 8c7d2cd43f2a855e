"""``LiveGroup``: a default process group that survives the loss and return of its members.

Survivors of a lost rank keep their processes and their memory. After a collective raised
because a peer died (gloo raises within about 0.1 s when a peer is killed) or timed out, each
survivor calls :meth:`LiveGroup.recover`: it destroys the broken default group (which also makes
every collective still blocked on this process fail at once, so all survivors notice), agrees
with the others on the next generation's membership through the store (:mod:`.agree`), and
builds a new default group over ``PrefixStore("phalanx/live/g<k>/pg/<tag>/", store)`` (the tag
derived from the job secret, :func:`.keys.pg_prefix`), in-process, without re-importing
anything. A replacement process of a dead slot constructs a ``LiveGroup`` with a higher
incarnation: it announces itself in its slot's signed join record and waits until
the survivors admit it in :meth:`LiveGroup.admit`, a cheap collective check at a step boundary
(rank 0 reads the join records of the slots missing from the membership: no shared counter, so
no stranger can hide a replacement).

Ranks follow slot order, so a replacement gets its slot's old rank back when the world size is
restored. After a generation with newcomers, hand them the state with
:func:`phalanx.recovery.transfer.share_state` from :attr:`LiveGroup.source`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.recovery import startup
from phalanx.recovery.agree import POLL_S, Board, members_key
from phalanx.recovery.errors import Excluded, JobFinished, RecoveryError
from phalanx.recovery.heartbeat import Heartbeat
from phalanx.recovery.keys import (
    FINISHED,
    _as_incarnation,
    dead_key,
    join_key,
    live_signer,
    pg_prefix,
)
from phalanx.recovery.membership import Member, admissible, is_dead, parse_members, sort_members
from phalanx.recovery.sockets import GroupSockets, InitWatch, abandon_group, socket_fds

__all__ = ["LiveGroup"]

INIT_TIMEOUT_S = 3.0
"""Rendezvous timeout of a generation's group: every member already said ready, so gloo's
connections take milliseconds; a member that died meanwhile then costs seconds, not minutes."""

MEMBERS_CHECK_S = 0.5
"""How often a waiting replacement checks that a member of the job is still alive."""

log = logging.getLogger(__name__)


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"LiveGroup: {name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _clone(store: dist.Store) -> dist.Store:
    """Another connection to ``store`` (torch's type stubs lack ``Store.clone``)."""
    return store.clone()  # type: ignore[attr-defined]


class LiveGroup:
    """This process's place in a job whose membership changes while it runs.

    Args:
        store: The job-long store (no prefix), e.g. the launcher's TCPStore.
        member_id: This worker slot's stable id (``"<node_rank>.<local_rank>"``).
        incarnation: 0 for the slot's first process, n for its n-th replacement (which joins).
        backend: c10d backend of every generation's default group: "gloo" (the only one
            supported so far: NCCL needs its communicators aborted, not cut, and is untested).
        rank: Launcher rank (incarnation 0 only: orders the first generation).
        world_size: Launcher world size (incarnation 0 only).
        timeout: Collective timeout of every generation's group, in seconds (its rendezvous
            uses ``min(timeout, INIT_TIMEOUT_S)``). A member that has not reached a recovery
            within ``2 * timeout + 6 * INIT_TIMEOUT_S`` of another, with a live heartbeat, is
            declared dead (it hangs).
        heartbeat_interval: Seconds between two heartbeats of this member.
        heartbeat_timeout: A member whose heartbeat has not moved for this long is dead.
        join_timeout: How long a replacement waits to be admitted (and the first generation to
            gather), in seconds. A replacement stops waiting as soon as the job's training is
            over (:class:`JobFinished`) or every member of the job died (:class:`RecoveryError`).
        secret: The job secret that signs the live-recovery keys (None: unsigned).
        nonce: The nonce of the store's join record (the scope of the signatures).
    """

    def __init__(
        self,
        store: dist.Store,
        member_id: str,
        incarnation: int,
        backend: str = "gloo",
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 15.0,
        join_timeout: float = 600.0,
        secret: bytes | None = None,
        nonce: str = "",
    ) -> None:
        if not isinstance(store, dist.Store):
            raise TypeError(
                f"LiveGroup: store must be a torch.distributed.Store (the job-long store, e.g. "
                f"the launcher's TCPStore), got store={store!r} ({type(store).__name__})"
            )
        if secret is not None and not isinstance(secret, bytes):
            raise TypeError(
                f"LiveGroup: secret must be bytes (the job secret, e.g. "
                f"os.environ['PHALANX_JOB_SECRET'].encode()) or None, got {type(secret).__name__}"
            )
        if not isinstance(member_id, str) or not member_id or "/" in member_id:
            raise ValueError(
                f"LiveGroup: member_id must be a slot id without '/', got {member_id!r}"
            )
        if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
            raise ValueError(f"LiveGroup: incarnation must be an int >= 0, got {incarnation!r}")
        if backend != "gloo":
            raise ValueError(
                f"LiveGroup: backend={backend!r} is not supported yet; live recovery works over "
                f"gloo (CPU tensors) so far: pass backend='gloo'"
            )
        if dist.is_initialized():
            raise RuntimeError(
                "LiveGroup builds the default process group itself, but one is already "
                "initialised; do not call init_process_group() before LiveGroup"
            )
        self._timeout = _seconds("timeout", timeout)
        self._init_timeout = min(self._timeout, INIT_TIMEOUT_S)
        hb_timeout = _seconds("heartbeat_timeout", heartbeat_timeout)
        self._join_timeout = _seconds("join_timeout", join_timeout)
        self._store, self._backend = store, backend
        self.me = Member(member_id, incarnation)
        self._live: SignedStore = live_signer(store, secret, nonce)
        # A survivor may reach the agreement one collective timeout after another, plus the time
        # a doomed rendezvous takes to fail (gloo: up to ~5x its timeout, measured).
        arrival = 2 * self._timeout + 6 * self._init_timeout
        self._board = Board(self._live, self.me, hb_timeout, arrival)
        self._members: list[Member] = []
        self._fresh: list[Member] = []
        self._sockets = GroupSockets()
        self._stateful = incarnation == 0  # a replacement holds no state until it receives it
        self._generation, self._rank = -1, -1
        self._slots: set[str] = set()
        """Every slot of the job (generation 0's and any seen since): whose join records to read."""
        self._last_error = ""
        """The last error of a generation that did not form (its text: a traceback would keep
        the objects of its frames alive)."""
        # One store connection per thread: a TCPStore client is one socket.
        beat_live = self._live.over(_clone(store))
        self._watch_board = dataclasses.replace(self._board, live=self._live.over(_clone(store)))
        beat = _seconds("heartbeat_interval", heartbeat_interval)
        self._heartbeat = Heartbeat(beat_live, self.me, beat, hb_timeout)
        if incarnation == 0:
            startup.check_start(self.me, rank, world_size)
        self._heartbeat.start()
        self.joined = False
        """True on a replacement admitted into the running job (it receives the state); False
        on a member of the first generation, which a replacement is too when it took the start
        slot of a process that died before the first generation formed."""
        try:
            if incarnation == 0 or startup.claim_start(self._live, self.me, rank, world_size):
                first = startup.gather(self._live, self.me, rank, world_size, self._join_timeout)
                self._advance(0, first, first)
            else:
                self.joined = True
                self._join()
        except BaseException:
            self._heartbeat.stop()  # a process that failed to join must not look alive
            raise

    @classmethod
    def from_env(cls, backend: str = "gloo", **options: float) -> LiveGroup:
        """The ``LiveGroup`` of a worker started by ``phalanx run --recovery live``.

        Reads ``PHALANX_MEMBER_ID``, ``PHALANX_INCARNATION``, ``RANK``, ``WORLD_SIZE`` and the
        store's ``MASTER_ADDR`` / ``MASTER_PORT``; ``options`` are the constructor's timeouts.
        """
        env = startup.read_env(timeout=float(options.get("timeout", 30.0)))
        return cls(
            env.store,
            env.member_id,
            env.incarnation,
            backend,
            rank=env.rank,
            world_size=env.world_size,
            secret=env.secret,
            nonce=env.nonce,
            **options,
        )

    @property
    def generation(self) -> int:
        """The current generation (0 for the first group; +1 per recovery or admission)."""
        return self._generation

    @property
    def rank(self) -> int:
        """This process's rank in the current generation's default group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of members of the current generation."""
        return len(self._members)

    @property
    def timeout(self) -> float:
        """The collective timeout of every generation's group, in seconds."""
        return self._timeout

    @property
    def members(self) -> tuple[Member, ...]:
        """The current generation's members, in rank order."""
        return tuple(self._members)

    @property
    def newcomers(self) -> list[int]:
        """Ranks of the members that do not hold the training state yet (replacements)."""
        return [r for r, m in enumerate(self._members) if m in self._fresh]

    @property
    def source(self) -> int | None:
        """Rank that sends state to :attr:`newcomers`: the first old member (None: all are new)."""
        fresh = set(self.newcomers)
        return next((r for r in range(self.world_size) if r not in fresh), None)

    def recover(self, error: BaseException | None = None) -> None:
        """Rebuild the default group without the failed members; call after a collective raised.

        Every survivor must call it (the ones whose collective has not failed yet will fail at
        their next one, since this cuts this process's connections of the broken group); one
        that arrives much later is declared dead (see ``timeout``).
        Returns when the new generation's group is up. A survivor may have completed the failed
        collective while another did not: agree on the step to redo before going on (e.g. an
        all-reduce MIN of the committed step count, rolling back the ones ahead).

        Raises:
            Excluded: this process was declared dead meanwhile: exit, a replacement will join.
            RecoveryError: no generation could be formed.
        """
        log.warning(
            "member %s (rank %d of generation %d) recovers after: %s",
            self.me,
            self._rank,
            self._generation,
            error or "a failed collective",
        )
        abandon_group(self._sockets)
        self._advance(self._generation + 1, self._members, None)

    def admit(self, before_change: Callable[[], object] = lambda: None) -> bool:
        """At a step boundary: admit waiting replacements; True when the membership changed.

        A collective over the current group (a one-element broadcast from rank 0, which reads
        the waiting joiners from the store); it raises like any collective when a peer failed
        (handle that with :meth:`recover`). ``before_change`` runs before the current group is
        torn down for a change: end the traffic still on it (background exchanges).
        """
        grow = self._waiting_joiners() if self._rank == 0 else []
        flag = torch.tensor([len(grow)], dtype=torch.int64)
        dist.broadcast(flag, 0)
        if int(flag.item()) == 0:
            return False
        before_change()
        abandon_group(self._sockets)
        proposal = sort_members([*self._members, *grow]) if self._rank == 0 else None
        self._advance(self._generation + 1, self._members, proposal)
        return True

    def check_peers(self) -> None:
        """Raise :class:`PeerLost` when a member of the current generation is recorded dead
        (the launcher's record, within about 0.1 s): for waits no collective cuts short."""
        where = f"member {self.me} (rank {self._rank} of generation {self._generation})"
        self._watch_board.check_alive(self._members, where)

    def state_received(self) -> None:
        """Record that this replacement now holds the training state (``share_state`` calls it)."""
        self._stateful = True
        if self.me in self._fresh:
            self._fresh.remove(self.me)

    def close(self) -> None:
        """Stop the heartbeat and destroy the default group (at the end of training); a
        replacement still waiting to be admitted then learns that the job finished."""
        try:
            self._live.put(FINISHED, self._generation)
        except (RuntimeError, OSError) as exc:  # the store is gone: nobody is left to tell
            log.info("member %s could not say the job finished: %s", self.me, exc)
        self._heartbeat.stop()
        abandon_group(self._sockets)

    def _where(self, k: int) -> str:
        return f"member {self.me} (rank {self._rank} of generation {self._generation}, forming {k})"

    def _advance(self, k: int, base: Sequence[Member], proposal: Sequence[Member] | None) -> None:
        """Agree on and build generation ``k`` (or a later one, if members fail meanwhile)."""
        tries = 2 * len(base) + 2  # each failed round loses at least one member
        for attempt in range(tries):
            agreed = self._board.agree(k, base, proposal)
            if self.me not in agreed:
                self._heartbeat.stop()
                raise Excluded(
                    f"{self._where(k)} was declared dead by its peers and is not in generation "
                    f"{k} ({', '.join(map(str, agreed))}); exit this process so the launcher "
                    f"starts a replacement, which receives the live state"
                )
            if self._form(k, agreed, attempt):
                return
            base, proposal, k = agreed, None, k + 1
        last = f" (the last: {self._last_error})" if self._last_error else ""
        raise RecoveryError(
            f"{self._where(k)}: no generation formed after {tries} tries{last}; "
            f"members keep failing: restart the job from its newest checkpoint"
        )

    def _form(self, k: int, agreed: list[Member], attempt: int = 0) -> bool:
        """Build generation ``k``'s default group; False when a member failed meanwhile.

        The group's rendezvous may take ``init_timeout`` doubled for each earlier failed
        attempt (at most the collective timeout): on a loaded machine a rendezvous of live
        members can outlast the first one (a dead member is cut at once by the watch)."""
        readiness = self._board.ready(k, agreed, self._stateful)
        if readiness.failed:
            lost = ", ".join(map(str, readiness.failed))
            log.warning("generation %d abandoned: %s failed while it formed", k, lost)
            return False
        rank = agreed.index(self.me)
        prefixed = dist.PrefixStore(pg_prefix(self._live, k), self._store)
        before = socket_fds()
        try:
            with InitWatch(lambda: self._any_dead(agreed), before):
                dist.init_process_group(
                    self._backend,
                    store=prefixed,
                    rank=rank,
                    world_size=len(agreed),
                    timeout=timedelta(seconds=min(self._timeout, self._init_timeout * 2**attempt)),
                )
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self._timeout))
        except Exception as exc:  # a member died between "ready" and the group's rendezvous, or
            # torch read junk in its own (unsigned) rendezvous keys (a std::length_error comes
            # out as ValueError): either way this generation failed, and the next one is formed
            log.warning("generation %d's group did not form on member %s: %s", k, self.me, exc)
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._sockets = GroupSockets.opened_since(before)
            abandon_group(self._sockets)
            return False
        self._sockets = GroupSockets.opened_since(before)
        self._note_slots(agreed)
        self._members, self._fresh = list(agreed), readiness.fresh
        self._generation, self._rank = k, rank
        self._heartbeat.watch(self._members)
        if rank == 0:
            self._live.put("current", k)
        log.info(
            "member %s is rank %d of %d in generation %d (without state: %s)",
            self.me,
            rank,
            len(agreed),
            k,
            ", ".join(map(str, self._fresh)) or "none",
        )
        return True

    def _any_dead(self, members: Sequence[Member]) -> bool:
        """True when one of ``members`` is recorded dead (read over the watch's connection)."""
        dead = self._watch_board.dead(members)
        return any(is_dead(m, dead) for m in members)

    def _note_slots(self, agreed: Sequence[Member]) -> None:
        """Remember the job's slots: generation 0's (read once, signed) and ``agreed``'s."""
        if not self._slots:
            first = self._live.get(members_key(0), parse_members) or []
            self._slots.update(m.member_id for m in first)
        self._slots.update(m.member_id for m in agreed)

    def _waiting_joiners(self) -> list[Member]:
        """Rank 0's scan of the join records of the slots missing from the membership: the
        replacements to admit now. A full membership reads nothing (a replacement of a slot
        still present waits until the survivors recovered from its predecessor anyway)."""
        present = {m.member_id for m in self._members}
        waiting = []
        for slot in sorted(self._slots - present):
            record = self._live.get(join_key(slot), parse_members)
            if record and len(record) == 1 and record[0].member_id == slot:
                waiting.append(record[0])
        if not waiting:
            return []
        now, _later = admissible(self._members, waiting, self._board.dead(waiting))
        return now

    def _announce(self) -> None:
        """Write this replacement's join record unless it is there (a stranger may delete or
        overwrite it; a newer incarnation's record is left alone: this one is stale)."""
        key = join_key(self.me.member_id)
        record = self._live.get(key, parse_members)
        me, there = self.me, record[0] if record else None
        if there and there.member_id == me.member_id and there.incarnation >= me.incarnation:
            return
        self._live.put(key, [self.me.to_json()])

    def _join(self) -> None:
        """A replacement: announce this member, then wait until a generation includes it."""
        self._announce()
        deadline = time.monotonic() + self._join_timeout
        members_checked = 0.0
        while time.monotonic() < deadline:
            current = self._live.get("current", _as_incarnation) or 0
            for k in range(current + 1, current + 4):
                agreed = self._live.get(members_key(k), parse_members)
                if agreed is not None and self.me in agreed:
                    if not self._form(k, agreed):
                        self._advance(k + 1, agreed, None)
                    return
            self._check_not_over()
            if time.monotonic() - members_checked > MEMBERS_CHECK_S:
                self._check_someone_left(current)
                self._announce()
                members_checked = time.monotonic()
            time.sleep(POLL_S)
        raise RecoveryError(
            f"member {self.me} was not admitted within join_timeout={self._join_timeout:g} s; "
            f"the members admit replacements only in LiveGroup.admit(): check that the training "
            f"loop calls it at every step boundary, or raise join_timeout"
        )

    def _check_not_over(self) -> None:
        """A waiting replacement: raise when the job finished or this member was declared dead."""
        if self._live.get(FINISHED) is not None:
            self._heartbeat.stop()
            raise JobFinished(
                f"member {self.me} arrived after the job's members finished training: "
                f"nothing is left to join; exit this process with success"
            )
        died = self._live.get(dead_key(self.me.member_id), _as_incarnation)
        if died is not None and died >= self.me.incarnation:
            self._heartbeat.stop()
            raise Excluded(
                f"member {self.me} was declared dead before it was admitted (incarnation "
                f"{died} of slot {self.me.member_id} is recorded dead); exit this process: "
                f"the launcher starts the slot's next incarnation"
            )

    def _check_someone_left(self, current: int) -> None:
        """A waiting replacement: raise when every member of generation ``current`` is dead:
        nobody is left to admit it or to hand it the training state."""
        members = self._live.get(members_key(current), parse_members)
        if not members:
            return  # the first generation has not formed yet
        dead = self._board.dead(members)
        if all(is_dead(m, dead) for m in members):
            self._heartbeat.stop()
            raise RecoveryError(
                f"member {self.me} cannot join: every member of generation {current} "
                f"({', '.join(map(str, members))}) died, so nobody holds the training state; "
                f"see their errors, then restart the job from its newest checkpoint"
            )
