"""The first generation, and what a worker of ``phalanx run --recovery live`` reads at start.

The first generation is every launcher rank's incarnation-0 process: each writes its slot at
``start/<rank>`` and waits for all ``world_size`` of them (a worker that dies before writing
its slot leaves the others waiting until ``join_timeout``: a failure at start is the restart
path's business). Replacements never come here; they join (:meth:`LiveGroup._join`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from phalanx.comm import join
from phalanx.comm.auth import job_secret
from phalanx.comm.env import discover_env
from phalanx.comm.signed import SignedStore
from phalanx.comm.store import connect_store
from phalanx.recovery.agree import POLL_S
from phalanx.recovery.errors import RecoveryError
from phalanx.recovery.keys import INCARNATION_ENV, MEMBER_ENV, RECOVERY_ENV
from phalanx.recovery.membership import Member, parse_members, sort_members

__all__ = ["LiveEnv", "claim_start", "gather", "live_mode", "read_env"]


def live_mode() -> bool:
    """True in a worker started by ``phalanx run --recovery live``."""
    return os.environ.get(RECOVERY_ENV, "") == "live"


def check_start(me: Member, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` of a slot's first process, checked.

    Raises:
        ValueError: missing, or ``rank`` outside ``0..world_size-1``.
    """
    if world_size is None or rank is None or not 0 <= rank < world_size:
        raise ValueError(
            f"LiveGroup: the first process of slot {me.member_id!r} (incarnation 0) needs "
            f"rank in 0..world_size-1, got rank={rank!r}, world_size={world_size!r}"
        )
    return rank, world_size


def claim_start(live: SignedStore, me: Member, rank: int | None, world_size: int | None) -> bool:
    """A replacement takes its slot's place in the first generation, if that has not formed
    and its first process died before it said it started (else it joins the running job)."""
    if rank is None or world_size is None or not 0 <= rank < world_size:
        return False
    if live.get("current") is not None:
        return False
    claimed = live.first(f"start/{rank}", [me.to_json()], parse_members)
    return bool(claimed) and claimed[0] == me


def gather(
    live: SignedStore, me: Member, rank: int | None, world_size: int | None, timeout: float
) -> list[Member]:
    """The first generation's members, in rank order, once all ``world_size`` have started.

    Raises:
        ValueError: ``rank`` / ``world_size`` missing or out of range.
        RecoveryError: not every rank started within ``timeout`` seconds (names the missing).
    """
    rank, world_size = check_start(me, rank, world_size)
    if me.incarnation == 0:  # a replacement claimed its slot already
        live.put(f"start/{rank}", [me.to_json()])
    found: dict[int, Member] = {}
    deadline = time.monotonic() + timeout
    while len(found) < world_size:
        for r in range(world_size):
            record = found.get(r) or _slot(live, r)
            if record is not None:
                found[r] = record
        if len(found) == world_size:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(found))
            raise RecoveryError(
                f"member {me} (rank {rank}): ranks {missing} of world_size={world_size} did not "
                f"start within join_timeout={timeout:g} s; start every worker (phalanx run "
                f"--recovery live does) or raise join_timeout"
            )
        time.sleep(POLL_S)
    return sort_members(found.values())


def _slot(live: SignedStore, rank: int) -> Member | None:
    record = live.get(f"start/{rank}", parse_members)
    return record[0] if record else None


@dataclass(frozen=True)
class LiveEnv:
    """What a live-recovery worker's environment says (see ``phalanx run --recovery live``)."""

    store: dist.Store
    member_id: str
    incarnation: int
    rank: int
    world_size: int
    secret: bytes | None = field(repr=False)
    nonce: str


def read_env(timeout: float) -> LiveEnv:
    """Connect to the job-long store and read this worker's slot, incarnation and signing scope.

    Raises:
        ValueError: ``PHALANX_MEMBER_ID`` unset, or ``PHALANX_INCARNATION`` / ``MASTER_ADDR``
            missing or malformed.
    """
    member_id = os.environ.get(MEMBER_ENV, "")
    if not member_id:
        raise ValueError(
            f"LiveGroup.from_env: {MEMBER_ENV} is not set; start the job with "
            f"`phalanx run --recovery live`, or construct LiveGroup(store, member_id, ...)"
        )
    raw = os.environ.get(INCARNATION_ENV, "0")
    if not raw.isdigit():
        raise ValueError(f"LiveGroup.from_env: {INCARNATION_ENV}={raw!r} is not an int >= 0")
    env = discover_env()
    if env.master_addr is None:
        raise ValueError("LiveGroup.from_env: MASTER_ADDR is not set; it names the job's store")
    limit = timedelta(seconds=timeout)
    store = connect_store(env.master_addr, env.master_port, limit)
    secret, run_id = job_secret(), os.environ.get("PHALANX_RUN_ID", "")
    where = f"{env.master_addr}:{env.master_port}"
    if store.check([join.HOST_KEY]):  # a phalanx launcher hosts it: verify its join record
        nonce = join.join_job(store, secret, env.rank, run_id, env.restart_count, where, limit)
    else:
        nonce = f"{run_id}/{env.restart_count}"
    return LiveEnv(store, member_id, int(raw), env.rank, env.world_size, secret, nonce)
