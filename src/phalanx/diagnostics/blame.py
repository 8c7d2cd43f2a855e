"""Who is to blame when a collective fails: which rank died, by which signal, in which call.

gloo aborts a rank (SIGABRT) when a message's size does not match (a shape or dtype mismatch,
a skipped collective); the survivors see "Connection reset by peer". A progress snapshot in the
store is up to half a second old, so it cannot tell whether the dead rank had entered the
collective. :func:`explain` looks at better evidence, waiting at most ``EVIDENCE_S`` for a
dying peer to be gone:

- a peer on this host: whether its process lives, its fatal-signal stack (faulthandler) and its
  call ring (:mod:`.call_ring`, written as it entered each call: exact, even after its death);
- a peer on another host: its last progress snapshot, said to be one, and where its files are;
  and that the network link to that host may be down or partitioned (unless a mismatch or a
  death on this host explains the failure).

A dead rank's last calls are compared with this rank's (:mod:`.pairing`), so a shape, dtype or
op mismatch is named with both calls even though gloo killed one side.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.comm.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.pairing import Divergence, first_mismatch
from phalanx.diagnostics.rank_files import Peer

__all__ = [
    "Account",
    "PeerState",
    "backend_text",
    "error",
    "explain",
    "peer_state",
    "timed_out",
]

EVIDENCE_S = 1.5
POLL_S = 0.05

Snapshot = Callable[[int], "dict[str, list[object]] | None"]


@dataclass
class PeerState:
    """One peer as the evidence shows it, relative to the failed collective."""

    rank: int
    reached: bool | None
    """Had it entered the collective (None: unknown from here)?"""
    text: str
    dead: bool = False
    calls: list[Record] | None = None
    stack: list[str] = field(default_factory=list)
    elsewhere: tuple[str, str] | None = None
    """``(host name, address)`` of the other machine it runs on (None: this one, or unknown)."""


def _last(calls: list[Record], group: str) -> Record | None:
    mine = [c for c in calls if c.group == group]
    return mine[-1] if mine else None


def _call(rec: Record) -> str:
    state = "in flight" if rec.end is None else "completed"
    return f"{rec.where()} (#{rec.seq} on group {rec.group}, {state})"


def _dead(rank: int, peer: Peer, calls: list[Record] | None, group: str, seq: int) -> PeerState:
    death = peer.death()
    sig, stack = death if death is not None else (None, [])
    how = f"killed by {sig}" if sig else "leaving no fatal-signal record (SIGKILL, or exit)"
    last = None if calls is None else _last(calls, group)
    where = "before its first collective" if last is None else f"after entering {_call(last)}"
    if last is not None and last.seq == seq and last.end is None:
        where = f"in {last.where()} (collective #{seq}, which it had entered)"
    reached = None if calls is None else last is not None and last.seq >= seq
    text = f"rank {rank} (pid {peer.pid}) died, {how}, {where}."
    return PeerState(rank, reached, text, True, calls, stack)


def peer_state(rank: int, peer: Peer | None, group: str, seq: int, snapshot: Snapshot) -> PeerState:
    """What this host can tell about ``rank`` and collective ``seq`` of ``group``."""
    here = peer is not None and peer.here()
    calls = peer.calls() if peer is not None and here else None
    if peer is not None and here and peer.alive() is False:
        return _dead(rank, peer, calls, group, seq)
    if calls is not None:
        last = _last(calls, group)
        if last is None:
            return PeerState(rank, False, f"rank {rank} has issued no collective yet.", calls=calls)
        state = "had entered it" if last.seq >= seq else "never reached it"
        text = f"rank {rank} {state}; its last call: {_call(last)}."
        return PeerState(rank, last.seq >= seq, text, calls=calls)
    away = (peer.host, peer.addr) if peer is not None and peer.elsewhere() else None
    snap = snapshot(rank)
    if snap is None or group not in snap:
        return PeerState(rank, None, f"rank {rank} reported no collective yet.", elsewhere=away)
    last_seq = int(snap[group][0])  # type: ignore[call-overload]
    if last_seq >= seq:
        text = f"rank {rank} had entered it (progress report #{last_seq})."
        return PeerState(rank, True, text, elsewhere=away)
    files = "" if peer is None else f"; its files: {peer.where('fatal')}, {peer.where('calls')}"
    text = (
        f"rank {rank} had entered #{last_seq} ({snap[group][1]}) as of its last progress report "
        f"(sent every 0.5 s: it may have gone further since{files})."
    )
    return PeerState(rank, None, text, elsewhere=away)


def _cut_off(states: list[PeerState]) -> list[str]:
    """For the peers on other machines: the network link to each may be down or partitioned.

    Their state comes from progress reports that stop when the link does, so a peer cut off
    looks as if it had entered the call, or fell behind, or died: the link is named beside
    those causes, never instead of them.
    """
    hosts: dict[tuple[str, str], list[int]] = {}
    for s in states:
        if s.elsewhere is not None:
            hosts.setdefault(s.elsewhere, []).append(s.rank)
    return [
        f"rank(s) {ranks} run on another machine ({host}{', ' + addr if addr else ''}): the "
        f"network link to it may be down or partitioned."
        for (host, addr), ranks in hosts.items()
    ]


@dataclass(frozen=True)
class Account:
    """The survivors' account of a failed collective."""

    text: str
    """Sentences: what differs, who is behind, each peer's state."""
    stacks: list[str]
    """Dead ranks' main threads at the signal (indented lines, most recent call first)."""
    divergence: Divergence | None


def explain(
    me: int,
    peers: dict[int, Peer | None],
    group: str,
    seq: int,
    mine: list[Record],
    snapshot: Snapshot,
    wait: bool,
    known: bool = False,
) -> Account:
    """Who is behind, who died (with its signal and call), and what differs.

    Args:
        me: This rank.
        peers: The other ranks of the group (None where a rank published no identity).
        group, seq: The failed collective.
        mine: This rank's last calls (its call ring when it has one: cut like the peers').
        snapshot: A rank's last progress snapshot from the store.
        wait: Wait up to ``EVIDENCE_S`` for a peer on this host to be seen dead.
        known: The mismatch is already stated (by the always-on check): do not repeat it.
    """
    states = _observe(peers, group, seq, snapshot, EVIDENCE_S if wait else 0.0)
    div = _mismatch(me, states, group, mine)
    behind = [s.rank for s in states if s.reached is False]
    lines = [] if div is None or known else [div.describe() + "."]
    if behind:
        lines.append(f"rank(s) {behind} never reached it.")
    elif not known and not any(s.dead for s in states) and all(s.reached for s in states):
        lines.append("every rank had reached it (a peer may have died during it).")
    if div is None and not known and not any(s.dead for s in states):
        lines.extend(_cut_off(states))
    stacks = []
    for s in states:
        lines.append(s.text)
        if s.stack:
            stacks.append(f"rank {s.rank} main thread at the signal (most recent call first):")
            stacks.extend("  " + ln for ln in _user_frames(s.stack))
    return Account(" ".join(lines), stacks, div)


def _observe(
    peers: dict[int, Peer | None], group: str, seq: int, snapshot: Snapshot, wait_s: float
) -> list[PeerState]:
    """The peers' states, looked at again until one on this host is dead or ``wait_s`` passed.

    A peer that gloo aborted closes its sockets as it dies: the survivor's error can come a
    moment before the process is gone, so a dying peer still looks alive at first.
    """
    deadline = time.monotonic() + wait_s
    local = any(p is not None and p.here() for p in peers.values())
    while True:
        states = [peer_state(r, p, group, seq, snapshot) for r, p in sorted(peers.items())]
        if not local or any(s.dead for s in states) or time.monotonic() >= deadline:
            return states
        time.sleep(POLL_S)


def _user_frames(stack: list[str], keep: int = 8) -> list[str]:
    """The frames outside torch, phalanx.comm and phalanx.diagnostics (faulthandler order: most
    recent first)."""
    inner = ("/torch/", "phalanx/comm/", "phalanx/diagnostics/", "/multiprocessing/")
    return [ln for ln in stack if not any(x in ln for x in inner)][:keep] or stack[:keep]


def _mismatch(
    me: int, states: list[PeerState], group: str, mine: list[Record]
) -> Divergence | None:
    own = {c.seq: c for c in mine if c.group == group}
    for s in states:
        if s.calls is not None:
            theirs = {c.seq: c for c in s.calls if c.group == group}
            div = first_mismatch({me: own, s.rank: theirs}, group)
            if div is not None:
                return div
    return None


def backend_text(exc: BaseException) -> str:
    """The first line of a backend error, without gloo's source location."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    # gloo prefixes its source location: "[/path/to/unbound_buffer.cc:78] Timed out ..."
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0])


def timed_out(text: str) -> bool:
    """Whether a backend error's text says it timed out."""
    return "timeout" in text.lower() or "timed out" in text.lower()


def error(
    rank: int,
    op: str,
    seq: int,
    group: str,
    text: str,
    found: str | None,
    account: Account | None,
) -> CollectiveError:
    """The error a survivor raises: a mismatch when one is known, else a timeout or failure."""
    mismatch = found is not None or (account is not None and account.divergence is not None)
    kind: type[CollectiveError] = CollectiveMismatchError
    if not mismatch:
        kind = CollectiveTimeoutError if timed_out(text) else CollectiveError
    where = f"[rank {rank}] {op} (collective #{seq} on group {group})"
    verb = "timed out" if timed_out(text) else "failed"
    detail = "" if found is None else found + ". "
    if account is not None:
        detail += account.text + " "
    msg = f"{where} {verb}: {detail}Backend said: {text}"
    if account is not None and account.stacks:
        msg += "\n" + "\n".join(account.stacks)
    return kind(msg)
