"""The contract of live recovery: the workers' variables, the store keys, and their signer.

``phalanx run --recovery live`` gives every worker ``PHALANX_RECOVERY=live``,
``PHALANX_MEMBER_ID=<node_rank>.<local_rank>`` (its slot, stable for the job) and
``PHALANX_INCARNATION=<n>`` (0 for the slot's first process, n for its n-th replacement);
``phalanx.launch.live_keys`` builds them.

All keys live under ``phalanx/live/`` in the job-long TCPStore of ``phalanx run --recovery live``
(the agent's). Every value is a signed frame (:mod:`phalanx.comm.signed`) under the scope
``"<join nonce>/live"``, where the nonce is the one of the store's join record
(:mod:`phalanx.comm.join`): a process without the job secret can neither declare a member dead
nor forge a membership. Per key (``M`` a slot id, ``k`` a generation)::

    dead/M           int    highest incarnation of slot M known dead (launcher, or a survivor
                            whose heartbeat check or arrival deadline expired)
    hb/M             {"incarnation", "beat"}  heartbeat of slot M, counted up every interval
    join/M           [M, incarnation]  slot M's replacement waiting to be admitted (one key
                     per slot: no counter, so nothing a stranger can bump decides who joins)
    current          int    the newest generation that formed (written by its rank 0)
    start/<r>        [M, incarnation]  the first process of launcher rank r (generation 0)
    g<k>/members     [[M, incarnation], ...]  generation k's membership; first writer wins
    g<k>/here/M      int    M's incarnation arrived at the agreement of generation k
    g<k>/ready/M     int    M read the membership of k and is about to build its process group
    g<k>/pg/<t>/...  torch's own rendezvous keys for generation k's process group (unsigned,
                     so ``t`` is derived from the secret: a stranger cannot plant junk under a
                     name it cannot know in advance; junk written there anyway, once the keys
                     appear, fails that generation, and the members form the next one)
    finished         the job's training is over: written by a member that closes its group,
                     and by the launcher when a worker exits 0 (a script that never calls
                     ``Job.close()``); a replacement still waiting to join then exits 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.comm.signed import SignedStore

if TYPE_CHECKING:
    from phalanx.comm.signed import AnyStore

__all__ = [
    "FINISHED",
    "INCARNATION_ENV",
    "LIVE_ENV",
    "MEMBER_ENV",
    "PREFIX",
    "RECOVERY_ENV",
    "dead_incarnation",
    "dead_key",
    "join_key",
    "live_signer",
    "pg_prefix",
    "report_death",
    "report_finished",
]

PREFIX = "phalanx/live/"
FINISHED = "finished"
"""Key that says the job's training is over: no generation will admit anyone after it."""
RECOVERY_ENV = "PHALANX_RECOVERY"
MEMBER_ENV = "PHALANX_MEMBER_ID"
INCARNATION_ENV = "PHALANX_INCARNATION"
LIVE_ENV = (RECOVERY_ENV, MEMBER_ENV, INCARNATION_ENV)
"""Every variable of the live contract (absent from a worker of ``--recovery restart``)."""


def live_signer(store: AnyStore, secret: bytes | None, nonce: str) -> SignedStore:
    """The signer of the live-recovery keys in ``store`` for the job whose join nonce is ``nonce``.

    Args:
        store: The job-long store (the agent's TCPStore), without any prefix.
        secret: The job secret (``PHALANX_JOB_SECRET`` as bytes), or None for an unsigned job.
        nonce: The nonce of the store's join record (``phalanx.comm.join.host_job``'s result).
    """
    return SignedStore(store, secret, f"{nonce}/live", PREFIX)


def dead_key(member_id: str) -> str:
    """Key of slot ``member_id``'s death record (relative to :data:`PREFIX`)."""
    return f"dead/{member_id}"


def join_key(member_id: str) -> str:
    """Key of slot ``member_id``'s join record (relative to :data:`PREFIX`)."""
    return f"join/{member_id}"


def pg_prefix(live: SignedStore, k: int) -> str:
    """The store prefix of generation ``k``'s process group (torch's own, unsigned keys).

    With a secret it holds a tag of the secret, the job's scope and ``k``: a process without the
    secret cannot know it before the keys appear, so it cannot plant junk for torch to read.
    """
    tag = live.encode(f"g{k}/pg", "rendezvous").split(" ", 2)[1]
    token = "" if tag == "-" else f"{tag[:32]}/"
    return f"{live.prefix}g{k}/pg/{token}"


def report_death(live: SignedStore, member_id: str, incarnation: int) -> None:
    """Record that incarnation ``incarnation`` of slot ``member_id`` died (the launcher's call).

    The survivors then drop it from the next generation at once instead of waiting for its
    heartbeat to go stale. A lower number than the one recorded is ignored (records only grow).

    Raises:
        ValueError: ``member_id`` is empty or ``incarnation`` is negative.
    """
    if not member_id:
        raise ValueError(f"report_death: member_id must be a non-empty slot id, got {member_id!r}")
    if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
        raise ValueError(f"report_death: incarnation must be an int >= 0, got {incarnation!r}")
    known = live.get(dead_key(member_id), _as_incarnation)
    if known is None or known < incarnation:
        live.put(dead_key(member_id), incarnation)


def report_finished(live: SignedStore, member_id: str) -> None:
    """Record that slot ``member_id``'s worker finished training (the launcher's call, when it
    exits 0): a replacement still waiting to be admitted then learns that nothing is left to
    join and exits 0, whether or not the finished worker closed its group."""
    live.put(FINISHED, member_id)


def dead_incarnation(live: SignedStore, member_id: str) -> int | None:
    """The newest incarnation of slot ``member_id`` recorded dead, or None (none, or forged)."""
    return live.get(dead_key(member_id), _as_incarnation)


def _as_incarnation(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"an incarnation must be an int >= 0, got {value!r}")
    return value
