"""``--recovery live`` on several nodes: a lost node is a loss of its workers; a node returns.

**Losing a node.** When node 0's agent hears no heartbeat from node ``N``'s agent for
``PHALANX_NODE_SILENCE_TIMEOUT`` seconds, :class:`NodeWatch` records the death of each of
``N``'s workers in the worker store (the marker a worker death writes, so the survivors regroup
at once), logs one line per lost rank, publishes ``N``'s outcome on its behalf (its workers
lost) and declares that agent's *life* lost. The job goes on at the smaller world. Node 0 hosts
the stores: losing it still ends the job.

**A node returns.** The same ``phalanx run`` command run again for node ``N`` finds generation
0 closed (:meth:`AgentStore.formed`) and rejoins (:func:`rejoin`): it waits until node 0 has
declared its previous life lost, claims one replacement per slot from the job's budget
(``--max-restarts``, all nodes together), claims the node's next life, and starts each slot's
worker as a replacement (next ``PHALANX_INCARNATION``): the running job admits them. Its
heartbeat key and its outcome are those of its life, so nothing of an earlier life counts.

**A slow agent declared lost** finds ``lost/<N>`` at its own life or later: it stops its workers
(already dropped from the job) and exits 1 (:func:`dropped`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.comm.signed import SignedStore
from phalanx.launch.live import JobBoard
from phalanx.launch.live_keys import member_id, replacement_env, report_death
from phalanx.launch.live_outcome import Death, NodeOutcome
from phalanx.launch.rendezvous import AgentStore, Rendezvous
from phalanx.launch.summary import Failure
from phalanx.launch.workers import WorkerSpec

__all__ = ["NodeWatch", "NotInJob", "Rejoining", "check_dropped", "rejoin", "rejoin_specs"]

POLL_S = 0.2


class NotInJob(RuntimeError):
    """This agent is not (or no longer) part of the running job: it cannot rejoin, or node 0
    declared it lost (the message says why and what to do)."""


class NodeWatch:
    """Node 0's view of the other nodes under ``--recovery live``: lost ones and returns."""

    def __init__(
        self,
        store: AgentStore,
        board: JobBoard,
        dead: SignedStore,
        silence: float,
        log: Callable[[str], None],
    ) -> None:
        self.store = store
        self.board = board
        self.dead = dead
        """Signer of the death markers in the worker store."""
        self.silence = silence
        self.log = log
        self.lost: dict[int, int] = {}
        """Node -> its life declared lost, while no newer life claimed it."""

    def poll(self) -> None:
        """Notice returns, then declare the newly silent nodes lost."""
        for node, life in list(self.lost.items()):
            newest = self.board.life(node)
            if newest > life:
                del self.lost[node]
                self.store.lives[node] = newest
                self.store.forget_heartbeats(node)
                self.log(f"node {node} is back (relaunched agent, life {newest}); watching it")
        for node in self.store.silent_nodes(self.silence):
            if node not in self.lost:
                self._declare_lost(node)

    def members(self) -> list[int]:
        """The nodes whose agent will say goodbye (every node but the lost ones)."""
        return [n for n in self.store.members if n not in self.lost]

    def _declare_lost(self, node: int) -> None:
        # Its workers died when the node went silent, not now: the survivors may have gone on
        # without them and finished meanwhile, which makes them lost, not dead after a finish.
        life, gone = self.store.lives.get(node, 0), self.store.heard_at(node)
        finished = self.board.finished_at()
        late = finished is not None and finished < gone
        why = f"no heartbeat from its agent for {self.silence:g} s, PHALANX_NODE_SILENCE_TIMEOUT"
        deaths = []
        for local, rank in enumerate(self.store.ranks(0, node)):
            member = member_id(node, local)
            incarnation = self.board.incarnation(member)
            report_death(self.dead, member, incarnation)
            failure = Failure(rank, local, node, 0, 1, reason=f"node {node} lost: {why}")
            deaths.append(Death(member, incarnation, gone, failure, False, late))
            self.log(
                f"node {node} lost ({why}): rank {rank} (member {member}, incarnation "
                f"{incarnation}) is lost; the others go on at a smaller world. To bring the "
                f"node back, run the same `phalanx run` command on node {node} again"
            )
        self.board.publish(NodeOutcome(node, [], deaths, life))
        self.board.declare_lost(node, life)
        self.lost[node] = life


def dropped(board: JobBoard, node: int, life: int) -> bool:
    """True when node 0 declared this agent (``node``'s life ``life``) lost."""
    return board.lost_life(node) >= life


def check_dropped(board: JobBoard, node: int, life: int, silence: float) -> None:
    """Raise :class:`NotInJob` when node 0 declared this agent lost (it was only slow)."""
    if dropped(board, node, life):
        raise NotInJob(
            f"node 0 declared node {node} lost (no heartbeat from this agent for {silence:g} "
            f"s) and the job went on without its workers; stopping them. Run the same "
            f"`phalanx run` command again to rejoin, or raise PHALANX_NODE_SILENCE_TIMEOUT"
        )


def rejoin_specs(specs: list[WorkerSpec], back: Rejoining) -> list[WorkerSpec]:
    """The slots' first specs, as the replacements ``back`` claimed (unclaimed slots dropped)."""
    return [
        dataclasses.replace(s, env=replacement_env(s.env, back.incarnations[s.local_rank]))
        for s in specs
        if s.local_rank in back.incarnations
    ]


@dataclass(frozen=True)
class Rejoining:
    """What a relaunched agent took: its life, the slots it runs and their incarnations."""

    life: int
    incarnations: dict[int, int]
    """Local rank -> incarnation of the replacement it starts there (claimed slots only)."""
    carried: list[Death]
    """The deaths of the node's earlier lives (those in a slot it runs: marked replaced)."""


def rejoin(
    store: AgentStore,
    board: JobBoard,
    rdzv: Rendezvous,
    nproc: int,
    timeout: float,
    check_stop: Callable[[], None],
) -> Rejoining:
    """Take node ``store.node_rank``'s place again in the running job ``rdzv``.

    Raises:
        NotInJob: the job is ending, the previous agent of the node was not declared lost
            within ``timeout`` s (it still runs), no replacement is left, or another agent
            rejoined as the node first.
    """
    node = store.node_rank
    if store.failure(0) is not None or board.someone_finished():
        raise NotInJob(f"node {node} cannot rejoin: the job is ending or has failed")
    previous = board.life(node)
    deadline = time.monotonic() + timeout
    while not dropped(board, node, previous):
        check_stop()
        if time.monotonic() > deadline:
            raise NotInJob(
                f"node {node} cannot rejoin: node 0 still counts its previous agent (life "
                f"{previous}) alive after {timeout:.0f} s; stop that agent first, or wait "
                f"PHALANX_NODE_SILENCE_TIMEOUT seconds after it died"
            )
        time.sleep(POLL_S)
    incarnations = {}
    for local in range(nproc):
        if board.claim_replacement(member_id(node, local)) is None:
            break
        incarnations[local] = board.incarnation(member_id(node, local))
    if not incarnations:
        used = board.max_replacements
        raise NotInJob(
            f"node {node} cannot rejoin: no replacement left ({used} of {used} used, "
            f"--max-restarts); the job goes on without it"
        )
    if not board.claim_life(node, previous + 1):
        raise NotInJob(f"node {node} cannot rejoin: another agent rejoined as node {node}")
    return Rejoining(previous + 1, incarnations, _carried(board, node, previous, incarnations))


def _carried(board: JobBoard, node: int, life: int, slots: dict[int, int]) -> list[Death]:
    """The earlier lives' deaths, a death in a slot that now runs again marked replaced."""
    before = board.outcome(node, life)
    rerun = {member_id(node, local) for local in slots}
    deaths = before.deaths if before is not None else []
    return [
        dataclasses.replace(d, replaced=True) if d.member in rerun and not d.replaced else d
        for d in deaths
    ]
