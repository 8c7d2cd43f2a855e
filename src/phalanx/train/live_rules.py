"""The rules of a live job: which failures it recovers from, which recovery and strategy a
``Job`` runs, and the record of each membership change (:mod:`phalanx.train.live` applies
them)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm.env import discover_env
from phalanx.comm.group import World
from phalanx.recovery import PeerLost
from phalanx.recovery.startup import live_mode
from phalanx.train.strategies.base import Strategy
from phalanx.train.strategies.ddp import DDP
from phalanx.train.strategies.zero import Zero

__all__ = [
    "MAX_IDLE_RECOVERIES",
    "Regroup",
    "check_strategy",
    "generation_world",
    "is_peer_failure",
    "live_recovery",
    "live_strategy",
]

log = logging.getLogger(__name__)
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


def check_strategy(chosen: Strategy, grad_accum: int, exact: bool) -> None:
    """Refuse what live recovery cannot run (before any process group exists)."""
    if not isinstance(chosen, (DDP, Zero)) or (exact and not isinstance(chosen, DDP)):
        raise ValueError(
            f"Job(recovery={'live-exact' if exact else 'live'!r}): strategy={chosen!r} "
            f"cannot recover live yet; live recovery supports phalanx.DDP() and "
            f"phalanx.Zero(stage=1|2|3), live-exact only DDP (use recovery='restart' for "
            f"the others)"
        )
    if isinstance(chosen, Zero) and chosen.shard != "world":
        raise ValueError(
            f"Job(recovery={'live-exact' if exact else 'live'!r}): strategy={chosen!r} "
            f"cannot recover live: live recovery regroups plain ZeRO (shard='world'); use "
            f"recovery='restart' with shard={chosen.shard!r}"
        )
    if grad_accum != 1:
        raise ValueError(
            f"Job(recovery='live', grad_accum={grad_accum}): live recovery redoes whole "
            f"steps of one batch; use grad_accum=1 and a larger batch_size"
        )


def live_strategy(chosen: Strategy, joined: bool) -> Strategy:
    """The strategy a live job runs: without the broadcasts of construction (the live job
    makes the replicas equal: rank 0's at the start, a live member's for a replacement that
    ``joined``) and, for DDP, of forward (buffers sync at the step)."""
    if isinstance(chosen, Zero):  # the first generation's constructors broadcast rank 0's
        return dataclasses.replace(chosen, init_sync=not joined)
    assert isinstance(chosen, DDP), "check_strategy refused the others"
    return dataclasses.replace(chosen, init_sync=False, forward_sync_buffers=False)


def generation_world(rank: int, world_size: int, before: World | None) -> World:
    """A member's :class:`phalanx.World` in a generation of ``world_size`` (``before``: its
    world in the previous one; None: made from the launcher's environment, on gloo and CPU)."""
    if before is None:
        env = discover_env()
        before = World(
            rank,
            world_size,
            env.local_rank,
            env.local_world_size,
            env.node_rank,
            torch.device("cpu"),
            "gloo",
        )
    return dataclasses.replace(before, rank=rank, world_size=world_size)


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

    def log(self) -> None:
        """One warning line for the job's log."""
        log.warning(
            "live recovery: generation %d, %d members, step %d (%s; %.3f s)",
            self.generation,
            self.world_size,
            self.step,
            self.kind,
            self.seconds,
        )
