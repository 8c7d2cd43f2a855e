"""One generation's worker store, as its host (node 0's agent) keeps it.

The agent hosts a fresh store per generation, bound to the master address, publishes the join
record in it (:mod:`phalanx.comm.join`) before any worker starts, and checks the workers'
proofs of the job secret while they run: a proof that does not verify (a process without the
secret wrote it) is logged once, naming its key, and never counted. Under ``--recovery live``
the other nodes' agents connect to it too, to write their workers' death markers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

from phalanx.comm import join, tcpstore
from phalanx.comm.signed import SignedStore
from phalanx.comm.tcpstore import StoreClient
from phalanx.launch.live_keys import live_signer

__all__ = ["WorkerStore"]

CHECK_EVERY_S = 1.0


@dataclass
class WorkerStore:
    """The store, its port, and the host's view of which ranks proved the secret."""

    store: StoreClient
    port: int
    signed: SignedStore
    """Signer of the workers' first process group (scope: the join nonce, generation 0)."""
    live: SignedStore
    """Signer of the ``--recovery live`` keys (:mod:`phalanx.launch.live_keys`)."""
    pending: set[int] = field(default_factory=set)
    """Ranks whose valid proof has not been seen yet."""
    next_check: float = 0.0

    @classmethod
    def host(
        cls, addr: str, timeout: timedelta, secret: bytes | None, run_id: str, generation: int
    ) -> WorkerStore:
        """Host a fresh worker store on ``addr`` (OS-chosen port) and publish its join record."""
        store, port = tcpstore.host(addr, 0, timeout)
        nonce = join.host_job(store, secret, run_id, generation, f"{addr}:{port}")
        return cls.of(store, port, secret, nonce)

    @classmethod
    def connect(
        cls, addr: str, port: int, timeout: timedelta, secret: bytes | None, run_id: str, rank: int
    ) -> WorkerStore:
        """Join the store at ``addr:port`` as a client (generation 0), as worker ``rank`` would.

        Raises:
            ConnectionError, TimeoutError, JobSecretError: as :func:`phalanx.comm.join.join_job`.
        """
        store = tcpstore.connect(addr, port, timeout)
        nonce = join.join_job(store, secret, rank, run_id, 0, f"{addr}:{port}", timeout)
        return cls.of(store, port, secret, nonce)

    @classmethod
    def of(cls, store: StoreClient, port: int, secret: bytes | None, nonce: str) -> WorkerStore:
        """The signers of the store whose join record has ``nonce``."""
        signed = SignedStore(store, secret, f"{nonce}/0")
        return cls(store, port, signed, live_signer(store, secret, nonce))

    def expect(self, world_size: int) -> None:
        """The workers of ranks ``0..world_size-1`` are about to start."""
        self.pending = set(range(world_size))

    def check_proofs(self) -> None:
        """At most once a second, until every rank has proved that it holds the secret."""
        now = time.monotonic()
        if self.pending and now >= self.next_check:
            self.next_check = now + CHECK_EVERY_S
            self.pending -= set(join.proven(self.signed, sorted(self.pending)))
