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
live job. When an agent sees a worker die (non-zero exit or a signal) it records the death there
with :func:`phalanx.recovery.keys.report_death` (key ``phalanx/live/dead/<member_id>``, the
incarnation that died, signed under ``<join nonce>/live``), and when a worker exits 0 it records
that the job's training is over with :func:`phalanx.recovery.keys.report_finished` (key
``phalanx/live/finished``: a replacement still waiting to join exits 0). The store protocol and
the variable names have one home, :mod:`phalanx.recovery.keys`, which the workers' library reads.
"""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.recovery.keys import (
    INCARNATION_ENV,
    LIVE_ENV,
    MEMBER_ENV,
    RECOVERY_ENV,
    dead_incarnation,
    live_signer,
    report_death,
    report_finished,
)

__all__ = [
    "INCARNATION_ENV",
    "LIVE_ENV",
    "MEMBER_ENV",
    "RECOVERY_ENV",
    "dead_incarnation",
    "live_env",
    "live_signer",
    "member_id",
    "replacement_env",
    "report_death",
    "report_finished",
]


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
