"""The agents' protocol over node 0's agent store: rendezvous per generation, failure, done.

Every key is namespaced by the generation ``g`` (``phalanx/g3/...``), so nothing a previous
attempt wrote can be mistaken for this one's (the stale-key bug of torchrun restarts). Workers
never see this store: each generation gets a fresh worker store, hosted by node 0's agent, whose
port is published under ``g{g}/worker_port``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.launch.summary import Failure, describe_failure

__all__ = ["AgentStore", "Rendezvous", "RendezvousError", "StoreLost"]

POLL_S = 0.05
LAST_CALL_S = 3.0
"""With ``--nnodes MIN:MAX``: once MIN nodes joined, how long node 0 waits for the others."""
WAIT_MESSAGE_EVERY_S = 10.0
HEARTBEAT_EVERY_S = 1.0


class StoreLost(RuntimeError):
    """The agent store stopped answering: node 0's agent is gone."""


class RendezvousError(RuntimeError):
    """A rendezvous cannot complete: a node is missing, duplicated, or the job already failed."""


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


class AgentStore:
    """Typed access to the agent store for the agent of node ``node_rank``."""

    def __init__(
        self,
        store: Any,
        node_rank: int,
        nnodes: int,
        log: Callable[[str], None],
        min_nodes: int = 0,
    ) -> None:
        self._store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.min_nodes = min_nodes or nnodes
        self.members = list(range(nnodes))
        """Node ranks of the current generation (all of them unless the job is elastic)."""
        self._log = log
        self._next_beat = 0.0
        self._next_check = 0.0
        self._beats: dict[int, tuple[int, float]] = {}

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (RuntimeError, OSError) as exc:
            raise StoreLost(
                f"lost the rendezvous store ({op} failed: {str(exc).splitlines()[0]}); "
                f"node 0's agent has probably exited"
            ) from None

    def _key(self, g: int, *parts: object) -> str:
        return "/".join(["phalanx", f"g{g}", *map(str, parts)])

    def publish_config(self, run_id: str, max_restarts: int) -> None:
        """Node 0: share the run id and restart budget with every node."""
        config = json.dumps({"run_id": run_id, "max_restarts": max_restarts})
        self._call("set", "phalanx/config", config)

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
                already joined with this node rank, or some node failed meanwhile.
        """
        self._claim_node_rank(g)
        self._call("set", self._key(g, "nproc", self.node_rank), str(nproc))
        if worker_port is not None:
            self._call("set", self._key(g, "worker_port"), str(worker_port))
        if self.node_rank == 0:  # node 0 closes the generation: who is in it
            members = self._gather_members(g, timeout, check_stop)
            self._call("set", self._key(g, "members"), ",".join(map(str, members)))
        keys = [self._key(g, "members"), self._key(g, "worker_port"), "phalanx/config"]
        self._wait_for(keys, timeout, check_stop, g)
        self.members = [int(n) for n in self._call("get", keys[0]).decode().split(",")]
        if self.node_rank not in self.members:
            raise RendezvousError(
                f"node {self.node_rank} joined generation {g} after node 0 had started it "
                f"with nodes {self.members} (--nnodes {self.min_nodes}:{self.nnodes})"
            )
        nprocs = [
            int(v)
            for v in self._call("multi_get", [self._key(g, "nproc", n) for n in self.members])
        ]
        mine = self.members.index(self.node_rank)
        config = json.loads(self._call("get", "phalanx/config"))
        return Rendezvous(
            generation=g,
            rank_offset=sum(nprocs[:mine]),
            world_size=sum(nprocs),
            worker_port=int(self._call("get", self._key(g, "worker_port"))),
            nnodes=len(self.members),
            run_id=config["run_id"],
            max_restarts=config["max_restarts"],
        )

    def _gather_members(self, g: int, timeout: float, check_stop: Callable[[], None]) -> list[int]:
        """Node 0: every node, or (elastic) the MIN or more that joined before the last call."""
        keys = [self._key(g, "nproc", n) for n in range(self.nnodes)]
        start, enough_since = time.monotonic(), None
        while True:
            joined = [n for n, key in enumerate(keys) if self._call("check", [key])]
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
                self._wait_for(keys, 0.0, check_stop, g)  # raises, naming the missing nodes
            check_stop()
            failed = self.failure(g)
            if failed is not None:
                why = " ".join(describe_failure(failed))
                raise RendezvousError(f"rendezvous (generation {g}) abandoned: {why}")
            time.sleep(POLL_S)

    def _claim_node_rank(self, g: int) -> None:
        """Fail everyone when two agents use the same --node-rank (else the job just hangs)."""
        if int(self._call("add", self._key(g, "joined", self.node_rank), 1)) == 1:
            return
        reason = (
            f"two agents joined as node {self.node_rank}; give every node its own --node-rank "
            f"(0..{self.nnodes - 1})"
        )
        self.publish_failure(g, Failure(-1, -1, self.node_rank, os.getpid(), 1, reason=reason))
        raise RendezvousError(reason)

    def _missing_nodes(self, g: int) -> list[int]:
        keys = [self._key(g, "nproc", n) for n in range(self.nnodes)]
        return [n for n, key in enumerate(keys) if not self._call("check", [key])]

    def _wait_for(
        self, keys: list[str], timeout: float, check_stop: Callable[[], None], g: int
    ) -> None:
        start = time.monotonic()
        next_message = start + WAIT_MESSAGE_EVERY_S
        while not self._call("check", keys):
            check_stop()
            failed = self.failure(g)
            if failed is not None:
                why = " ".join(describe_failure(failed))
                raise RendezvousError(f"rendezvous (generation {g}) abandoned: {why}")
            now = time.monotonic()
            if now - start > timeout:
                raise RendezvousError(
                    f"nodes {self._missing_nodes(g)} did not join the rendezvous (generation "
                    f"{g}) within --rdzv-timeout {timeout:.0f} s; start them with --nnodes "
                    f"{self.nnodes} and the same --master-addr/--master-port"
                )
            if now >= next_message:
                self._log(
                    f"waiting for nodes {self._missing_nodes(g)} to join (generation {g}, "
                    f"{now - start:.0f} s of {timeout:.0f} s)"
                )
                next_message = now + WAIT_MESSAGE_EVERY_S
            time.sleep(POLL_S)

    def publish_failure(self, g: int, failure: Failure) -> Failure:
        """Record ``failure`` unless another node was first; return the first failure."""
        first = self._call("compare_set", self._key(g, "failure"), "", failure.to_json())
        return Failure.from_json(first)

    def failure(self, g: int) -> Failure | None:
        """The first failure of generation ``g``, if some node published one."""
        key = self._key(g, "failure")
        if not self._call("check", [key]):
            return None
        return Failure.from_json(self._call("get", key))

    def mark(self, g: int, what: str) -> None:
        """Say ``what`` (``done``: local workers succeeded; ``exit``: leaving) for this node."""
        self._call("set", self._key(g, what, self.node_rank), "1")

    def all_marked(self, g: int, what: str) -> bool:
        """True when every node of generation ``g`` has said ``what``."""
        return bool(self._call("check", [self._key(g, what, n) for n in self.members]))

    def wait_all_marked(self, g: int, what: str, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every node to say ``what``; False on timeout."""
        deadline = time.monotonic() + timeout
        while not self.all_marked(g, what):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def heartbeat(self) -> None:
        """Bump this node's heartbeat counter, at most once a second."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._call("add", f"phalanx/heartbeat/{self.node_rank}", 1)
            self._next_beat = now + HEARTBEAT_EVERY_S

    def forget_heartbeats(self) -> None:
        """Start silence tracking afresh (after a rendezvous, during which nobody beats)."""
        self._beats.clear()

    def silent_nodes(self, timeout: float) -> list[int]:
        """Nodes whose heartbeat counter has not moved for ``timeout`` s (checked by node 0)."""
        now, silent = time.monotonic(), list[int]()
        if now < self._next_check:
            return silent
        self._next_check = now + HEARTBEAT_EVERY_S
        for n in self.members[1:]:
            count = int(self._call("add", f"phalanx/heartbeat/{n}", 0))
            last_count, since = self._beats.get(n, (-1, now))
            if count != last_count:
                self._beats[n] = (count, now)
            elif now - since > timeout:
                silent.append(n)
        return silent
