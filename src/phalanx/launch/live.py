"""``--recovery live`` on one node: a dead worker is replaced alone, the others run on.

When a worker of this node exits non-zero or by a signal, the agent

1. claims one replacement from the job's budget (``--max-restarts``, counted over every slot
   of every node, in the agent store);
2. writes the death marker in the worker store (:mod:`.live_keys`), so that the survivors
   need not wait for a heartbeat to time out (after the claim: a survivor that reads the
   marker may finish at once, and a death after a finish is judged differently, see below);
3. starts the replacement in the same slot: the slot's first environment with the next
   ``PHALANX_INCARNATION``, its output appended to the slot's log files;
4. logs one line naming the rank, member id, incarnation, pid, how it ended and what was done.

Before that, at every poll, the agent kills the workers the job declared dead and the ones that
stay stopped (:mod:`.live_enforce`): their deaths are then handled the same way.

With no replacement left the slot is *lost* and the others go on at a smaller world. A worker
that dies after some worker of the job finished is not replaced: the job was ending, so that
death fails it (:mod:`.live_outcome`). When a worker exits 0 the agent writes the finish marker
in the worker store, so that a replacement still waiting to join exits 0 instead of waiting
out its ``join_timeout`` (the finished worker may not have closed its job). Once every worker
here has exited, the agent publishes the node's outcome; the job's exit code follows from every
node's.

Agent-store keys (signed under the job's nonce, as the rest of the agents' protocol):
``phalanx/live/replacement/<n>`` (who took the n-th replacement; the first valid claim wins),
``phalanx/live/finished`` (the first worker that finished), ``phalanx/live/outcome/<node>/<life>``,
``phalanx/live/life/<node>/<n>`` (the n-th relaunched agent of the node, first claim wins) and
``phalanx/live/lost/<node>`` (the newest life of the node that node 0 declared lost);
:mod:`.live_nodes` uses the last two.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any

from phalanx.comm.signed import SignedStore
from phalanx.launch.events import Events
from phalanx.launch.live_enforce import Enforcer
from phalanx.launch.live_keys import (
    INCARNATION_ENV,
    MEMBER_ENV,
    replacement_env,
    report_death,
    report_finished,
)
from phalanx.launch.live_outcome import Death, NodeOutcome, node_outcome, to_json
from phalanx.launch.rendezvous import store_call
from phalanx.launch.summary import failure_of
from phalanx.launch.workers import Worker, WorkerGroup, WorkerSpec

__all__ = ["JobBoard", "LiveNode"]

KEYS = "phalanx/live/"


def _finish(value: Any) -> float:
    if not (isinstance(value, dict) and isinstance(value.get("at"), int | float)):
        raise TypeError("the first finish is an object with a time")
    return float(value["at"])


class JobBoard:
    """The live job's shared facts in the agent store (``signed``: the agents' job signer)."""

    def __init__(self, signed: SignedStore, max_replacements: int) -> None:
        self.signed = signed
        self.max_replacements = max_replacements
        self._next = 1
        """No replacement below this number is free."""
        self._finished = False

    def claim_replacement(self, member: str) -> int | None:
        """Take the next free replacement of the job's budget: its number, or None if none."""
        mine = {"member": member, "token": secrets.token_hex(8)}
        while self._next <= self.max_replacements:  # claims are never given back
            n, self._next = self._next, self._next + 1
            if store_call(self.signed.first, f"{KEYS}replacement/{n}", mine) == mine:
                return n
        return None

    def note_finished(self, member: str) -> None:
        """Say (once) that a worker of the job finished: later deaths are not replaced."""
        if not self._finished:
            first = {"member": member, "at": time.time()}
            store_call(self.signed.first, f"{KEYS}finished", first)
            self._finished = True

    def someone_finished(self) -> bool:
        """True when some worker of the job, on any node, has finished."""
        return self._finished or store_call(self.signed.get, f"{KEYS}finished") is not None

    def finished_at(self) -> float | None:
        """When (``time.time()``) the job's first worker finished, if one has."""
        return store_call(self.signed.get, f"{KEYS}finished", _finish)

    def publish(self, outcome: NodeOutcome) -> None:
        """Publish a node's outcome (all of its workers have exited, or node 0 lost it). The
        first one of a node's life stands: a slow agent's, after node 0's, is ignored."""
        key = f"{KEYS}outcome/{outcome.node}/{outcome.life}"
        store_call(self.signed.first, key, to_json(outcome))

    def outcome(self, node: int, life: int) -> NodeOutcome | None:
        """The outcome ``node``'s agent of ``life`` published (or node 0 for it), if any."""
        return store_call(self.signed.get, f"{KEYS}outcome/{node}/{life}", node_outcome)

    def outcomes(self, nodes: list[int]) -> list[NodeOutcome] | None:
        """Every node's outcome (its newest life's), or None while some node's workers run."""
        found = [self.outcome(n, self.life(n)) for n in nodes]
        return None if any(o is None for o in found) else [o for o in found if o is not None]

    def life(self, node: int) -> int:
        """The newest life of ``node``'s agent: how many relaunched agents claimed the node."""
        life = 0
        while store_call(self.signed.get, f"{KEYS}life/{node}/{life + 1}") is not None:
            life += 1
        return life

    def claim_life(self, node: int, life: int) -> bool:
        """Claim life ``life`` of ``node`` for this agent; False if another agent took it."""
        mine = {"token": secrets.token_hex(8)}
        return store_call(self.signed.first, f"{KEYS}life/{node}/{life}", mine) == mine

    def declare_lost(self, node: int, life: int) -> None:
        """Node 0: ``node``'s agent of ``life`` is lost (its writes no longer count)."""
        store_call(self.signed.put, f"{KEYS}lost/{node}", life)

    def lost_life(self, node: int) -> int:
        """The newest life of ``node`` declared lost (-1: none)."""
        lost = store_call(self.signed.get, f"{KEYS}lost/{node}")
        return lost if isinstance(lost, int) else -1

    def incarnation(self, member: str) -> int:
        """The newest incarnation of slot ``member``: the replacements it claimed so far."""
        n, count = 1, 0
        while (claim := store_call(self.signed.get, f"{KEYS}replacement/{n}")) is not None:
            count += isinstance(claim, dict) and claim.get("member") == member
            n += 1
        return count


class LiveNode:
    """This node's workers under live recovery: replace the dead, record how each slot ended."""

    def __init__(
        self,
        workers: WorkerGroup,
        node: int,
        board: JobBoard,
        dead: SignedStore,
        log: Callable[[str], None],
        events: Events | None = None,
        life: int = 0,
        carried: list[Death] | None = None,
    ) -> None:
        self.workers = workers
        self.life = life
        """This agent's life as the node (:mod:`.live_nodes`)."""
        self.node = node
        self.board = board
        self.dead = dead
        """Signer of the live keys in the worker store (death and finish markers)."""
        self.log = log
        self.events = events
        self.first = [w.spec for w in workers.workers]
        """Each slot's first spec: a replacement's differs only in PHALANX_INCARNATION."""
        self.handled: set[int] = set()
        """``id()`` of the workers whose exit was handled (the group keeps every one alive)."""
        self.finished: list[str] = []
        self.deaths: list[Death] = list(carried or [])
        """Every death, with those of the node's earlier lives (``carried``) first."""
        self.ended: set[int] = set()
        """Positions (in ``workers.workers``) of the slots that ended (finished or lost)."""
        self.enforcer = Enforcer(dead, log)
        """Kills the workers the job declared dead, and stopped ones (:mod:`.live_enforce`)."""

    def poll(self) -> None:
        """Kill the condemned workers, then handle every exit since the last poll, in the
        order the processes exited."""
        self.enforcer.poll(self.workers.running())
        exited = [w for w in self.workers.workers if w.returncode is not None]
        for worker in sorted(exited, key=lambda w: w.exited_at or 0.0):
            if id(worker) not in self.handled:
                self.handled.add(id(worker))
                self._on_exit(worker)

    def all_exited(self) -> bool:
        """True when every slot of this node has ended."""
        return len(self.ended) == len(self.first)

    def outcome(self) -> NodeOutcome:
        """What this node reports once :meth:`all_exited`."""
        return NodeOutcome(self.node, sorted(self.finished), list(self.deaths), self.life)

    def _on_exit(self, worker: Worker) -> None:
        member = worker.spec.env[MEMBER_ENV]
        if worker.returncode != 0:
            self._on_death(worker, member)
            return
        self.finished.append(member)
        self.ended.add(self._slot(worker))
        self.board.note_finished(member)
        self._mark_finished(member)

    def _on_death(self, worker: Worker, member: str) -> None:
        local, incarnation = self._slot(worker), int(worker.spec.env[INCARNATION_ENV])
        # Decide before the marker is out: a survivor that reads it may finish at once.
        late = self.board.someone_finished()
        n = None if late else self.board.claim_replacement(member)
        self._mark_dead(member, incarnation)
        for thread in worker.threads[:2]:  # let the pumps drain so the traceback is in the tail
            thread.join(0.5)
        failure = failure_of(worker, self.node)
        if (why := self.enforcer.reason(worker)) is not None:
            failure = dataclasses.replace(failure, reason=f"killed by its agent (SIGKILL): {why}")
        death = Death(member, incarnation, time.time(), failure, n is not None, late)
        self.deaths.append(death)
        if n is None:
            self.ended.add(local)
            self.log(f"{death.describe()}: {self._why_not(late)}")
            return
        new = self.workers.replace(local, self._spec(local, incarnation + 1))
        if self.events is not None:
            self.events.replaced(worker, new)
        self.log(
            f"{death.describe()}: replaced by pid {new.pid} (incarnation {incarnation + 1}; "
            f"replacement {n} of {self.board.max_replacements}, --max-restarts)"
        )

    def _slot(self, worker: Worker) -> int:
        """The position of ``worker``'s slot (a rejoined node may run only some slots)."""
        return [s.local_rank for s in self.first].index(worker.spec.local_rank)

    def _why_not(self, late: bool) -> str:
        if late:
            return "not replaced, since a worker of the job already finished; the job will fail"
        used = self.board.max_replacements
        return f"no replacement left ({used} of {used} used, --max-restarts); the others go on"

    def _spec(self, local: int, incarnation: int) -> WorkerSpec:
        first = self.first[local]
        return dataclasses.replace(first, env=replacement_env(first.env, incarnation))

    def _mark_finished(self, member: str) -> None:
        """Tell a replacement still waiting to join that the training is over (the worker may
        have exited without closing its job, which says so too)."""
        try:
            report_finished(self.dead, member)
        except (RuntimeError, OSError) as exc:
            self.log(
                f"cannot write the end of member {member}'s training to the worker store: {exc}"
            )

    def _mark_dead(self, member: str, incarnation: int) -> None:
        try:
            report_death(self.dead, member, incarnation)
        except (RuntimeError, OSError) as exc:
            self.log(f"cannot write the death of member {member} to the worker store: {exc}")
