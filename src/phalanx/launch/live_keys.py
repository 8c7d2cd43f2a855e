"""The contract of ``phalanx run --recovery live`` with the workers: variables and store keys.

Under ``--recovery live`` every worker's environment has, besides torchrun's variables:

- ``PHALANX_RECOVERY=live``;
- ``PHALANX_MEMBER_ID=<node_rank>.<local_rank>``: the worker *slot*, stable for the whole job;
- ``PHALANX_INCARNATION=<n>``: 0 for the slot's first process, ``n`` for its n-th replacement.

A replacement gets exactly its slot's first environment except ``PHALANX_INCARNATION``; its
``RANK`` and ``WORLD_SIZE`` are then only hints (the worker library assigns ranks). Under
``--recovery restart`` (the default) none of the three is set: the launcher removes them from
the environment it passes on.

The worker store (``MASTER_ADDR:MASTER_PORT``, hosted by node 0's agent) lives for the whole
live job. When an agent sees a worker die (non-zero exit or a signal) it writes, in that store:

- key ``phalanx/live/dead/<member_id>`` (no prefix), e.g. ``phalanx/live/dead/0.1``;
- value: a :class:`~phalanx.comm.signed.SignedStore` frame whose JSON is the incarnation that
  died, a bare integer: ``phx1 <hmac hex> 0`` (``phx1 - 0`` in a job without a secret);
- signed under scope ``<join nonce>/live`` (:func:`live_signer`), where the nonce is the one
  of the store's join record (:func:`phalanx.comm.join.join_job` returns it; a live job's
  restart count is always 0). The HMAC covers the full key name, so a signer with prefix
  ``phalanx/live/`` and key ``dead/<member_id>`` produces the same frame.

Records only grow: a slot that dies again overwrites its key with the larger incarnation, and a
smaller one is never written over a larger (a survivor may have declared it dead first). Read
it with :func:`dead_incarnation`; a forged or malformed value reads as None (logged once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from phalanx.comm.signed import SignedStore

__all__ = [
    "DEAD_PREFIX",
    "INCARNATION_ENV",
    "LIVE_ENV",
    "MEMBER_ENV",
    "RECOVERY_ENV",
    "dead_incarnation",
    "dead_key",
    "live_env",
    "live_signer",
    "mark_dead",
    "member_id",
    "replacement_env",
]

RECOVERY_ENV = "PHALANX_RECOVERY"
MEMBER_ENV = "PHALANX_MEMBER_ID"
INCARNATION_ENV = "PHALANX_INCARNATION"
LIVE_ENV = (RECOVERY_ENV, MEMBER_ENV, INCARNATION_ENV)
"""Every variable of the live contract (removed from the workers' environment in restart mode)."""
DEAD_PREFIX = "phalanx/live/dead/"


def member_id(node_rank: int, local_rank: int) -> str:
    """The stable id of a worker slot: ``"<node_rank>.<local_rank>"``."""
    return f"{node_rank}.{local_rank}"


def live_env(node_rank: int, local_rank: int, incarnation: int = 0) -> dict[str, str]:
    """The three variables of one worker slot's ``incarnation``-th process."""
    return {
        RECOVERY_ENV: "live",
        MEMBER_ENV: member_id(node_rank, local_rank),
        INCARNATION_ENV: str(incarnation),
    }


def replacement_env(env: Mapping[str, str], incarnation: int) -> dict[str, str]:
    """A slot's first environment ``env`` for its ``incarnation``-th process (n >= 1)."""
    if env.get(RECOVERY_ENV) != "live" or MEMBER_ENV not in env:
        raise ValueError(f"env is not a live worker's environment ({RECOVERY_ENV} is not live)")
    if incarnation < 1:
        raise ValueError(f"incarnation of a replacement must be >= 1, got {incarnation}")
    return {**env, INCARNATION_ENV: str(incarnation)}


def dead_key(member: str) -> str:
    """Store key of the death marker of worker slot ``member``."""
    return DEAD_PREFIX + member


def live_signer(store: dist.Store, secret: bytes | None, nonce: str) -> SignedStore:
    """The signer of the live keys in the worker store whose join record has ``nonce``."""
    return SignedStore(store, secret, f"{nonce}/live")


def mark_dead(signer: SignedStore, member: str, incarnation: int) -> None:
    """Say that process ``incarnation`` of slot ``member`` died (unless a later one is known)."""
    known = dead_incarnation(signer, member)
    if known is None or known < incarnation:
        signer.put(dead_key(member), incarnation)


def _incarnation(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise TypeError(f"an incarnation is an integer >= 0, got {value!r}")
    return value


def dead_incarnation(signer: SignedStore, member: str) -> int | None:
    """The newest incarnation of slot ``member`` that died, or None (none died, or forged)."""
    return signer.get(dead_key(member), _incarnation)
