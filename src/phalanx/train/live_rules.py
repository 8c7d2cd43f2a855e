"""The rules of a live job: which failures it recovers from, which recovery a ``Job`` runs,
and the record of each membership change (:mod:`phalanx.train.live` applies them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from phalanx.recovery import PeerLost
from phalanx.recovery.startup import live_mode

__all__ = ["MAX_IDLE_RECOVERIES", "Regroup", "is_peer_failure", "live_recovery"]

MAX_IDLE_RECOVERIES = 3
"""Recoveries in a row at one step that lose nobody before the job gives up (a collective that
fails for another reason than a lost member would otherwise be redone forever)."""
_PEER_WORDS = ("connection", "gloo", "timed out", "timeout", "closed", "broken pipe", "peer")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed because of a peer (not a bug of this rank)."""
    if isinstance(exc, dist.DistError | PeerLost):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _PEER_WORDS)


def live_recovery(recovery: str | None) -> str | None:
    """``Job(recovery=)`` resolved: "live" or "live-exact", or None for the restart path
    (``recovery=None`` follows the launcher's ``--recovery``)."""
    chosen = recovery or ("live" if live_mode() else "restart")
    return None if chosen == "restart" else chosen


@dataclass(frozen=True)
class Regroup:
    """One membership change of a live job, as this member saw it."""

    kind: str
    """"lost" (a collective failed), or "joined" (replacements admitted at a boundary)."""
    generation: int
    """The generation formed."""
    world_size: int
    """Members of that generation."""
    step: int
    """Committed steps when it formed (after the exchange)."""
    seconds: float
    """From noticing the change to the new group's state being settled."""
    source: int | None
    """Rank that sent the state to the members behind (None: everyone was at that step)."""
