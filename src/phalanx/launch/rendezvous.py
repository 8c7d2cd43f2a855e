"""The agents' protocol over node 0's agent store: rendezvous per generation, failure, done.

Every key is namespaced by the generation ``g`` (``phalanx/g3/...``), so nothing a previous
attempt wrote can be mistaken for this one's (the stale-key bug of torchrun restarts). Workers
never see this store: each generation gets a fresh worker store, hosted by node 0's agent, whose
port is published under ``g{g}/worker_port``.

Every value is signed with the job secret (:mod:`phalanx.comm.signed`). Node 0 publishes the
job's config (run id, restart budget and a fresh nonce) under the fixed scope ``agent-config``;
every other value is signed under the nonce. A node whose secret differs fails as soon as it
reads the config, naming the job and the store; a node proves that it holds the secret with its
first value, its join record ``g{g}/nproc/<node>``, which node 0 verifies before counting it.
Claims, failures, marks and heartbeats are signed values too, not counters, so a process
without the secret cannot join, stop, finish or keep alive anything.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx.comm.backends import shm_unusable
from phalanx.comm.signed import Rejected, SignedStore, claimed
from phalanx.launch import agent_values as values
from phalanx.launch.node_claims import NoNodeRank, PreviousLife, is_previous_life, my_claim
from phalanx.launch.node_claims import take_node_rank as _take_node_rank
from phalanx.launch.summary import Failure, describe_failure

if TYPE_CHECKING:
    from phalanx.comm.signed import AnyStore

__all__ = ["AgentStore", "Rendezvous", "RendezvousError", "StoreLost", "store_call"]

T = TypeVar("T")
CONFIG_KEY = "phalanx/config"
GENERATION_KEY = "phalanx/generation"
"""Node 0's current generation, where a relaunched agent starts."""
POLL_S = 0.05
LAST_CALL_S = 3.0
"""With ``--nnodes MIN:MAX``: once MIN nodes joined, how long node 0 waits for the others."""
WAIT_MESSAGE_EVERY_S = 10.0
HEARTBEAT_EVERY_S = 1.0


class StoreLost(RuntimeError):
    """The agent store stopped answering: node 0's agent is gone."""


class RendezvousError(RuntimeError):
    """A rendezvous cannot complete: a node is missing, duplicated, or the job already failed."""


def store_call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a call on the agent store; its failure raises :class:`StoreLost`."""
    try:
        return fn(*args)
    except (RuntimeError, OSError) as exc:
        raise StoreLost(
            f"lost the rendezvous store ({getattr(fn, '__name__', fn)} failed: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            f"node 0's agent has probably exited"
        ) from None


@dataclass(frozen=True)
class Rendezvous:
    """What one generation's rendezvous agreed on, seen from one node."""

    generation: int
    rank_offset: int
    """Global rank of this node's local rank 0 (prefix sum of lower nodes' nproc)."""
    world_size: int
    """Sum of every node's nproc."""
    worker_port: int
    """Port of this generation's fresh worker store on the master address."""
    nnodes: int
    """Nodes in this generation (fewer than --nnodes' maximum after a node was lost)."""
    run_id: str
    max_restarts: int
    """Node 0's --max-restarts, so that all nodes agree on whether to restart."""
    fewest_local: int = 0
    """The fewest ranks any node of the generation can put on shared memory: its nproc, 0 on a
    node where shm cannot run. With 2 or more, "auto" is the hierarchical shm group across
    nodes (``comm.backends.auto_backend``); the workers get it as
    ``PHALANX_MIN_LOCAL_WORLD_SIZE``."""


class AgentStore:
    """Typed, signed access to the agent store for the agent of node ``node_rank``."""

    def __init__(
        self,
        store: AnyStore,
        node_rank: int,
        nnodes: int,
        log: Callable[[str], None],
        min_nodes: int = 0,
        secret: bytes | None = None,
        where: str = "node 0",
    ) -> None:
        self._store = store
        self._config = SignedStore(store, secret, "agent-config")
        self._job: SignedStore | None = None
        """The signer under the job's nonce, once the config is known."""
        self.config: values.JobConfig | None = None
        self.where = where
        """``addr:port`` of the store, for error messages."""
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.min_nodes = min_nodes or nnodes
        self.members = list(range(nnodes))
        """Node ranks of the current generation (all of them unless the job is elastic)."""
        self._log = log
        self._token = secrets.token_hex(8)
        """Tells this agent's claims of its node rank from a twin's."""
        self._beat = 0
        self._next_beat = 0.0
        self._next_check = 0.0
        self._beats: dict[int, tuple[int, float]] = {}
        self.life = 0
        """This agent's life as its node (``--recovery live``: 1 for the first relaunch...)."""
        self.lives: dict[int, int] = {}
        """Node 0: the life of each node whose heartbeat it watches (absent: 0)."""

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return store_call(fn, *args)

    def _key(self, g: int, *parts: object) -> str:
        return "/".join(["phalanx", f"g{g}", *map(str, parts)])

    @property
    def signed(self) -> SignedStore:
        """The job's signer (after :meth:`publish_config` or the first rendezvous)."""
        assert self._job is not None, "the job's config is not known yet"
        return self._job

    def _get(self, key: str, parse: Callable[[Any], T]) -> T | None:
        return self._call(self.signed.get, key, parse)

    def _put(self, key: str, value: object) -> None:
        self._call(self.signed.put, key, value)

    def _use(self, config: values.JobConfig) -> values.JobConfig:
        self._job = SignedStore(self._store, self._config.secret, f"agent/{config.nonce}")
        self.config = config
        return config

    def publish_config(self, run_id: str, max_restarts: int) -> None:
        """Node 0: share the run id, the restart budget and the job's nonce with every node."""
        config = values.JobConfig(run_id, max_restarts, secrets.token_hex(16))
        self._call(self._config.put, CONFIG_KEY, asdict(config))
        self._use(config)

    def _read_config(self, timeout: float, check_stop: Callable[[], None]) -> values.JobConfig:
        """Wait for node 0's config; refuse it when it is not signed with this node's secret."""
        deadline = time.monotonic() + timeout
        while (raw := self._call(self._config.raw, CONFIG_KEY)) is None:
            check_stop()
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node 0 published no job config at {self.where} within --rdzv-timeout "
                    f"{timeout:.0f} s; is a phalanx launcher running there?"
                )
            time.sleep(POLL_S)
        try:
            return self._use(self._config.decode(CONFIG_KEY, raw, values.job_config))
        except Rejected as why:
            raise RendezvousError(
                f"node {self.node_rank} on {socket.gethostname()} cannot join job "
                f"{claimed(raw, 'run_id')!r} at the rendezvous store {self.where}: node 0's "
                f"config was refused ({why}); set the same PHALANX_JOB_SECRET on every node"
            ) from None

    def rendezvous(
        self,
        g: int,
        nproc: int,
        worker_port: int | None,
        timeout: float,
        check_stop: Callable[[], None],
    ) -> Rendezvous:
        """Publish this node's nproc for generation ``g`` and wait for every node's.

        Node 0 passes the port of the generation's fresh worker store; the others pass None.

        Raises:
            RendezvousError: a node did not join within ``timeout`` seconds, another agent
                already joined with this node rank, this node's secret is not the job's, or
                some node failed meanwhile.
        """
        config = self.config or self._read_config(timeout, check_stop)
        self._claim_node_rank(g)
        joined_here = values.Joined(nproc, _host(), shm_unusable() is None)
        self._put(self._key(g, "nproc", self.node_rank), asdict(joined_here))
        if worker_port is not None:
            self._put(self._key(g, "worker_port"), worker_port)
        if self.node_rank == 0:  # node 0 closes the generation: who is in it
            self._put(self._key(g, "members"), self._gather_members(g, timeout, check_stop))
        wanted: list[tuple[str, Callable[[Any], object]]] = [
            (self._key(g, "members"), values.members),
            (self._key(g, "worker_port"), values.port),
        ]
        self.members, port = self._wait_for(wanted, timeout, check_stop, g)
        if self.node_rank not in self.members:
            raise RendezvousError(
                f"node {self.node_rank} joined generation {g} after node 0 had started it "
                f"with nodes {self.members} (--nnodes {self.min_nodes}:{self.nnodes})"
            )
        joined: list[tuple[str, Callable[[Any], object]]] = [
            (self._key(g, "nproc", n), values.joined) for n in self.members
        ]
        records = self._wait_for(joined, timeout, check_stop, g)
        nprocs = [j.nproc for j in records]
        mine = self.members.index(self.node_rank)
        return Rendezvous(
            generation=g,
            rank_offset=sum(nprocs[:mine]),
            world_size=sum(nprocs),
            worker_port=port,
            nnodes=len(self.members),
            run_id=config.run_id,
            max_restarts=config.max_restarts,
            fewest_local=_fewest_local(records),
        )

    def formed(self, g: int, timeout: float, check_stop: Callable[[], None]) -> Rendezvous | None:
        """Generation ``g`` as this node was given it, if node 0 already closed it (else None):
        how a relaunched agent of a running ``--recovery live`` job finds its slots."""
        config = self.config or self._read_config(timeout, check_stop)
        members = self._get(self._key(g, "members"), values.members)
        port = self._get(self._key(g, "worker_port"), values.port)
        if members is None or port is None or self.node_rank not in members:
            return None
        self.members = members
        world = sum(len(self.ranks(g, n)) for n in members)
        first = self.ranks(g, self.node_rank).start
        records = [self._get(self._key(g, "nproc", n), values.joined) for n in members]
        fewest = _fewest_local([j for j in records if j is not None])
        return Rendezvous(
            g, first, world, port, len(members), config.run_id, config.max_restarts, fewest
        )

    def ranks(self, g: int, node: int) -> range:
        """The global ranks of ``node``'s workers in generation ``g`` (empty if not in it)."""
        if node not in self.members:
            return range(0)
        joined = [self._get(self._key(g, "nproc", n), values.joined) for n in self.members]
        nprocs = [j.nproc if j is not None else 0 for j in joined]
        first = sum(nprocs[: self.members.index(node)])
        return range(first, first + nprocs[self.members.index(node)])

    def _joined(self, g: int) -> list[int]:
        """Nodes whose valid join record for generation ``g`` is in the store."""
        parse = values.joined
        return [n for n in range(self.nnodes) if self._get(self._key(g, "nproc", n), parse)]

    def _gather_members(self, g: int, timeout: float, check_stop: Callable[[], None]) -> list[int]:
        """Node 0: every node, or (elastic) the MIN or more that joined before the last call."""
        start, enough_since = time.monotonic(), None
        while True:
            joined = self._joined(g)
            if len(joined) == self.nnodes:
                return joined
            now = time.monotonic()
            if len(joined) >= self.min_nodes:
                enough_since = enough_since or now
                if now - enough_since >= LAST_CALL_S:
                    self._log(
                        f"generation {g} starts with nodes {joined} (--nnodes "
                        f"{self.min_nodes}:{self.nnodes}; nodes {self._missing_nodes(g)} absent)"
                    )
                    return joined
            elif now - start > timeout:
                self._raise_missing(g, timeout)
            self._check_failed(g, check_stop)
            time.sleep(POLL_S)

    def _claim_node_rank(self, g: int) -> None:
        """Fail everyone when two agents use the same --node-rank (else the job just hangs).

        Raises:
            PreviousLife: the claim is this host's previous, dead agent's (a relaunch).
        """
        key = self._key(g, "joined", self.node_rank)
        first = self._call(self.signed.first, key, asdict(my_claim(self._token)), values.claim)
        if first.token == self._token:
            return
        if is_previous_life(first, self._token):
            raise PreviousLife(g, first)
        reason = (
            f"two agents joined as node {self.node_rank} (the other on {first.host}, pid "
            f"{first.pid}); give every node its own --node-rank (0..{self.nnodes - 1})"
        )
        self.publish_failure(g, Failure(-1, -1, self.node_rank, os.getpid(), 1, reason=reason))
        raise RendezvousError(reason)

    def publish_generation(self, g: int) -> None:
        """Node 0: generation ``g`` is the job's current one."""
        self._put(GENERATION_KEY, g)

    def generation(self, timeout: float, check_stop: Callable[[], None]) -> int:
        """The job's current generation (0 before node 0 published one)."""
        self.config or self._read_config(timeout, check_stop)
        return self._get(GENERATION_KEY, values.count) or 0

    def wait_generation(self, after: int, timeout: float, check_stop: Callable[[], None]) -> int:
        """Wait until node 0 starts a generation later than ``after``; return it.

        Raises:
            RendezvousError: none started within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while (g := self.generation(timeout, check_stop)) <= after:
            check_stop()
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"node {self.node_rank}: this host's previous agent holds its place in "
                    f"generation {after}, and node 0 started no later generation within "
                    f"--rdzv-timeout {timeout:.0f} s (a job with --max-restarts 0 cannot take "
                    f"a relaunched node back)"
                )
            time.sleep(POLL_S)
        return g

    def take_node_rank(self, timeout: float, check_stop: Callable[[], None]) -> int:
        """An agent started without --node-rank that does not host the store: take a rank
        (:func:`phalanx.launch.node_claims.take_node_rank`)."""
        self.config or self._read_config(timeout, check_stop)
        try:
            self.node_rank = _take_node_rank(
                self.signed, self.nnodes, self._token, timeout, check_stop, self.where
            )
        except NoNodeRank as exc:
            raise RendezvousError(str(exc)) from None
        return self.node_rank

    def _missing_nodes(self, g: int) -> list[int]:
        joined = self._joined(g)
        return [n for n in range(self.nnodes) if n not in joined]

    def _check_failed(self, g: int, check_stop: Callable[[], None]) -> None:
        check_stop()
        failed = self.failure(g)
        if failed is not None:
            why = " ".join(describe_failure(failed))
            raise RendezvousError(f"rendezvous (generation {g}) abandoned: {why}")

    def _raise_missing(self, g: int, timeout: float) -> None:
        raise RendezvousError(
            f"nodes {self._missing_nodes(g)} did not join the rendezvous (generation "
            f"{g}) within --rdzv-timeout {timeout:.0f} s; start them with --nnodes "
            f"{self.nnodes}, the same --master-addr/--master-port and the same "
            f"PHALANX_JOB_SECRET"
        )

    def _wait_for(
        self,
        wanted: list[tuple[str, Callable[[Any], Any]]],
        timeout: float,
        check_stop: Callable[[], None],
        g: int,
    ) -> list[Any]:
        """Wait until every key holds a valid value (a forged one does not count); return them."""
        start = time.monotonic()
        next_message = start + WAIT_MESSAGE_EVERY_S
        while True:
            values = [self._get(key, parse) for key, parse in wanted]
            if all(v is not None for v in values):
                return values
            self._check_failed(g, check_stop)
            now = time.monotonic()
            if now - start > timeout:
                self._raise_missing(g, timeout)
            if now >= next_message:
                self._log(
                    f"waiting for nodes {self._missing_nodes(g)} to join (generation {g}, "
                    f"{now - start:.0f} s of {timeout:.0f} s)"
                )
                next_message = now + WAIT_MESSAGE_EVERY_S
            time.sleep(POLL_S)

    def publish_failure(self, g: int, failure: Failure) -> Failure:
        """Record ``failure`` unless another node was first; return the first failure.

        A forged or junk value at the key does not count as first: it is replaced.
        """
        key = self._key(g, "failure")
        return self._call(self.signed.first, key, asdict(failure), values.failure)

    def failure(self, g: int) -> Failure | None:
        """The first failure of generation ``g``, if some node published one."""
        return self._get(self._key(g, "failure"), values.failure)

    def mark(self, g: int, what: str) -> None:
        """Say ``what`` (``done``: local workers succeeded; ``exit``: leaving) for this node."""
        self._put(self._key(g, what, self.node_rank), {"node": self.node_rank})

    def all_marked(self, g: int, what: str) -> bool:
        """True when every node of generation ``g`` has said ``what`` (in a signed value)."""
        keys = [self._key(g, what, n) for n in self.members]
        if not self._call(self.signed.exists, keys):
            return False
        return all(v is not None for v in self._call(self.signed.get_present, keys))

    def wait_all_marked(self, g: int, what: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every node to say ``what``; False on timeout."""
        deadline = time.monotonic() + timeout
        while not self.all_marked(g, what):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def heartbeat(self) -> None:
        """Publish this node's next heartbeat number, at most once a second."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._beat += 1
            self._put(_beat_key(self.node_rank, self.life), self._beat)
            self._next_beat = now + HEARTBEAT_EVERY_S

    def forget_heartbeats(self, node: int | None = None) -> None:
        """Start silence tracking afresh (after a rendezvous, during which nobody beats), for
        every node or only ``node`` (a node that rejoined with a new life)."""
        if node is None:
            self._beats.clear()
        else:
            self._beats.pop(node, None)

    def silent_nodes(self, timeout: float) -> list[int]:
        """Nodes whose heartbeat has not grown for ``timeout`` s (checked by node 0).

        Only a larger signed number counts: a replayed older beat keeps no node alive.
        """
        now, silent = time.monotonic(), list[int]()
        if now < self._next_check:
            return silent
        self._next_check = now + HEARTBEAT_EVERY_S
        for n in self.members[1:]:
            count = self._get(_beat_key(n, self.lives.get(n, 0)), values.count) or 0
            last_count, since = self._beats.get(n, (-1, now))
            if count > last_count:
                self._beats[n] = (count, now)
            elif now - since > timeout:
                silent.append(n)
        return silent

    def heard_at(self, node: int) -> float:
        """When (``time.time()``) node 0 last saw ``node``'s heartbeat grow (or began to watch
        it): about when a silent node went away."""
        _, since = self._beats.get(node, (0, time.monotonic()))
        return time.time() - (time.monotonic() - since)


def _beat_key(node: int, life: int) -> str:
    """Heartbeat key of ``node``'s agent in its ``life`` (a relaunched agent has its own)."""
    return f"phalanx/heartbeat/{node}" + (f"/life{life}" if life else "")


def _host() -> str:
    return socket.gethostname()


def _fewest_local(records: list[values.Joined]) -> int:
    """:attr:`Rendezvous.fewest_local` from the generation's join records."""
    return min((j.nproc if j.shm else 0 for j in records), default=0)
