"""Joining a worker store: every worker proves that it holds the job secret.

The host of a generation's worker store (node 0's agent under ``phalanx run``; rank 0 when it
hosts a ``tcp://`` or ``env://`` rendezvous itself) writes a *join record* at
``phalanx/join/host``: the run id, a fresh random nonce and the store's address, signed with the
job secret and bound to the run id and restart count. A worker reads and verifies it before it
touches torch's own rendezvous keys, so a worker with another job's secret, or none where the
job has one, fails at once with an error naming the job and the store, instead of hanging in a
job whose values it cannot verify. It then writes its proof at ``phalanx/join/rank/<r>``:
HMAC(secret, nonce | key) over its rank, host and pid, which the host checks. The nonce is the
scope of every value the generation signs afterwards (:mod:`.signed`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING

from phalanx.comm.signed import JobSecretError, Rejected, SignedStore, as_record, claimed

if TYPE_CHECKING:
    from phalanx.comm.signed import AnyStore

__all__ = ["HOST_KEY", "host_job", "join_job", "proof_key", "prove", "proven"]

HOST_KEY = "phalanx/join/host"


def proof_key(rank: int) -> str:
    """Key of rank ``rank``'s proof that it holds the job secret."""
    return f"phalanx/join/rank/{rank}"


@dataclasses.dataclass(frozen=True)
class JoinRecord:
    """What the host of a worker store tells every worker that joins it."""

    run_id: str
    nonce: str
    """Fresh per store: the scope of the generation's signed values."""
    host: str
    """``addr:port`` of the store, for error messages."""


@dataclasses.dataclass(frozen=True)
class Proof:
    """A worker's proof that it holds the job secret."""

    rank: int
    host: str
    pid: int


def _record_store(store: AnyStore, secret: bytes | None, run_id: str, restart: int) -> SignedStore:
    return SignedStore(store, secret, f"join/{run_id}/{restart}")


def host_job(store: AnyStore, secret: bytes | None, run_id: str, restart: int, where: str) -> str:
    """Publish the join record of a fresh worker store; return its nonce."""
    nonce = secrets.token_hex(16)
    record = JoinRecord(run_id, nonce, where)
    _record_store(store, secret, run_id, restart).put(HOST_KEY, dataclasses.asdict(record))
    return nonce


def join_job(
    store: AnyStore,
    secret: bytes | None,
    rank: int,
    run_id: str,
    restart: int,
    where: str,
    timeout: timedelta,
) -> str:
    """Verify the host's join record as rank ``rank``; return its nonce.

    Raises:
        JobSecretError: the record is not signed with this process's secret (another job's
            secret, none where the job has one, or the reverse), naming the job and the store.
        TimeoutError: no join record within ``timeout`` (the store's host is not phalanx).
    """
    signer = _record_store(store, secret, run_id, restart)
    try:
        signer.wait_exists([HOST_KEY], timeout)
        raw = signer.raw(HOST_KEY)
    except RuntimeError:
        raw = None
    if raw is None:
        raise TimeoutError(
            f"rank {rank} on {socket.gethostname()}: the store at {where} holds no phalanx join "
            f"record after {timeout.total_seconds():.0f} s; is its host a phalanx launcher "
            f"of the same version?"
        )
    try:
        record = signer.decode(HOST_KEY, raw, functools.partial(as_record, JoinRecord))
    except Rejected as why:
        job = claimed(raw, "run_id")
        ours = f" (this process was started for job {run_id!r})" if run_id != job else ""
        raise JobSecretError(
            f"rank {rank} on {socket.gethostname()} cannot join job {job!r} through its worker "
            f"store at {where}{ours}: the job's join record was refused ({why}). Give every "
            f"process of the job the same PHALANX_JOB_SECRET (`phalanx run` hands its workers "
            f"the job's own), or start this worker through `phalanx run`"
        ) from None
    return record.nonce


def prove(job: SignedStore, rank: int) -> None:
    """Write rank ``rank``'s proof (signed under the generation's nonce scope)."""
    job.put(proof_key(rank), dataclasses.asdict(Proof(rank, socket.gethostname(), os.getpid())))


def proven(job: SignedStore, ranks: Iterable[int]) -> list[int]:
    """The host's check: the ranks among ``ranks`` whose valid proof is in the store.

    A forged proof (written by a process without the secret) is logged once and not counted.
    """
    parse = functools.partial(as_record, Proof)
    return [r for r in ranks if (p := job.get(proof_key(r), parse)) is not None and p.rank == r]
