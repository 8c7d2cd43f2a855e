"""The node agent: rendezvous, start workers, watch them, restart or stop everyone.

One agent runs per node. Generation ``g`` goes: rendezvous (agree on ranks and on a fresh
worker store) -> start the local workers -> monitor until every node is done, or some worker
fails. A failure stops the workers on every node; with restarts left all agents meet again at
``g + 1``, otherwise every agent exits non-zero with the first failure's summary.

With ``--recovery live`` there is one generation and one worker store for the whole job: a
dead worker is replaced alone (:mod:`.live`; one the job declared dead, or a stopped one, is
killed first: :mod:`.live_enforce`) and the job ends when every worker has exited. A
lost node (no heartbeat for 30 s) is a loss of its workers, and its agent, run again, rejoins
(:mod:`.live_nodes`); a signal to an agent or the loss of node 0 (it hosts the stores) ends the
job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

from phalanx.comm.auth import SECRET_ENV, new_secret
from phalanx.comm.flags import env_seconds
from phalanx.comm.signed import JobSecretError
from phalanx.launch.attempt import worker_specs
from phalanx.launch.backend_note import BackendNotes
from phalanx.launch.config import LaunchConfig
from phalanx.launch.events import Events
from phalanx.launch.live import JobBoard, LiveNode
from phalanx.launch.live_keys import INCARNATION_ENV, MEMBER_ENV
from phalanx.launch.live_nodes import NodeWatch, NotInJob, check_dropped, rejoin, rejoin_specs
from phalanx.launch.live_outcome import NodeOutcome, verdict
from phalanx.launch.logs import RunLogs
from phalanx.launch.node_claims import PreviousLife
from phalanx.launch.rendezvous import AgentStore, Rendezvous, RendezvousError, StoreLost
from phalanx.launch.summary import Failure, describe_failure, failure_of, format_summary
from phalanx.launch.worker_store import WorkerStore
from phalanx.launch.workers import WorkerGroup

__all__ = ["Agent", "AgentStopped"]

STOP_GRACE_S = 3.0
EXIT_ACK_TIMEOUT_S = 10.0
PEER_SILENCE_TIMEOUT_S = 30.0
"""Seconds without a node agent's heartbeat before node 0 declares that node lost (default;
``PHALANX_NODE_SILENCE_TIMEOUT`` sets it)."""
NODE_SILENT = "no heartbeat from its agent"


def node_silence_timeout() -> float:
    """``PHALANX_NODE_SILENCE_TIMEOUT`` (seconds > 0), else :data:`PEER_SILENCE_TIMEOUT_S`."""
    return env_seconds("PHALANX_NODE_SILENCE_TIMEOUT", PEER_SILENCE_TIMEOUT_S)


def _silent(failure: Failure) -> bool:
    """Whether node 0 declared ``failure``'s node lost for its silence."""
    return (failure.reason or "").startswith(NODE_SILENT)


class AgentStopped(Exception):
    """The agent received SIGINT/SIGTERM/SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Agent:
    """The agent of one node, over an already-open agent store."""

    def __init__(self, cfg: LaunchConfig, store: Any, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.node = cfg.node_rank
        self.silence = node_silence_timeout()  # a bad value is refused before anything starts
        # One secret per job: the user's on several machines (each needs the same), else new.
        self.secret = os.environ.get(SECRET_ENV) or (new_secret() if cfg.nnodes == 1 else None)
        key = self.secret.encode() if self.secret else None
        where = f"{cfg.master_addr}:{cfg.master_port}"
        self.store = AgentStore(store, cfg.node_rank, cfg.nnodes, log, cfg.min_nodes, key, where)
        self.log = log
        self.workers: WorkerGroup | None = None
        self.worker_store: WorkerStore | None = None
        self.signals: list[int] = []
        self.nproc = cfg.nproc_per_node
        self.generation = 0
        self.logs = RunLogs(cfg.logs, log)
        self.events = Events(cfg)
        self.backend_notes = BackendNotes(cfg.backend)

    def run(self) -> int:
        """Run generations until success, final failure or a signal; return the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in self.cfg.signals_to_handle}
        try:
            return self._run()
        except AgentStopped as stop:
            return self._stopped_by_signal(stop.signum)
        except (StoreLost, RendezvousError, NotInJob) as exc:
            self.log(str(exc))
            if isinstance(exc, StoreLost) and self.cfg.recovery == "live":
                self.log("node 0 hosts the live job's stores: losing it ends the whole job")
            self._stop_workers()
            return 1
        finally:
            if self.workers is not None:
                self.workers.stop(grace=0.0)
            self.logs.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def check_stop(self) -> None:
        """Raise AgentStopped when a signal arrived (called from every waiting loop)."""
        if self.signals:
            raise AgentStopped(self.signals[0])

    def _run(self) -> int:
        if self.cfg.node_rank_auto:
            self._take_node_rank()
        if self.node == 0:
            run_id = self.cfg.rdzv_id or uuid.uuid4().hex[:12]
            self.store.publish_config(run_id, self.cfg.max_restarts)
        if self.cfg.recovery == "live":
            return self._run_live()
        g = 0 if self.node == 0 else self.store.generation(self.cfg.rdzv_timeout, self.check_stop)
        while True:
            self.generation = g
            rdzv = self._rendezvous(g)
            g = self.generation = rdzv.generation
            failure = self._start_workers(rdzv) or self._monitor(g)
            if failure is None:
                return self._finish(g)
            if self._restartable(failure) and g < rdzv.max_restarts:
                self._restart(g, failure, rdzv.max_restarts)
                g += 1
                continue
            return self._fail(g, failure, rdzv.max_restarts)

    def _take_node_rank(self) -> None:
        """Started without --node-rank, not hosting the store: take a free node rank."""
        self.node = self.store.take_node_rank(self.cfg.rdzv_timeout, self.check_stop)
        self.cfg = dataclasses.replace(self.cfg, node_rank=self.node, node_rank_auto=False)
        self.log(
            f"node rank {self.node} of {self.cfg.nnodes} taken at the rendezvous store "
            f"{self.cfg.master_addr}:{self.cfg.master_port} (no --node-rank given)"
        )

    def _restartable(self, failure: Failure) -> bool:
        """A worker failed, or (``--nnodes MIN:MAX``) a node was lost: the rest go on."""
        elastic = 0 < self.cfg.min_nodes < self.cfg.nnodes
        return failure.rank >= 0 or (elastic and _silent(failure))

    def _rendezvous(self, g: int) -> Rendezvous:
        """Meet the other nodes at generation ``g`` (a relaunched node: at the next one)."""
        while True:
            try:
                return self._meet(g)
            except PreviousLife as previous:
                if self.cfg.recovery == "live":  # its rejoin is :meth:`_rejoin_live`'s
                    raise RendezvousError(
                        f"node {self.node}: this host's previous agent (pid "
                        f"{previous.claim.pid}) joined the live job before it formed"
                    ) from None
                self.log(
                    f"node {self.node}: this host's previous agent (pid {previous.claim.pid}) "
                    f"holds the node's place in generation {g}; joining the job's next "
                    f"generation when node 0 starts it"
                )
                g = self.store.wait_generation(g, self.cfg.rdzv_timeout, self.check_stop)

    def _meet(self, g: int) -> Rendezvous:
        port = None
        new_store = None
        if self.node == 0:
            self.store.publish_generation(g)
            timeout = timedelta(seconds=self.cfg.rdzv_timeout)
            run_id = self.store.config.run_id if self.store.config else ""
            secret = self.store.signed.secret
            new_store = WorkerStore.host(self.cfg.master_addr, timeout, secret, run_id, g)
            port = new_store.port
        rdzv = self.store.rendezvous(g, self.nproc, port, self.cfg.rdzv_timeout, self.check_stop)
        if new_store is not None:
            # Every node has met at g, so every worker of g - 1 is gone: drop its store.
            self.worker_store = new_store
            new_store.expect(rdzv.world_size)
        return rdzv

    def _start_workers(self, rdzv: Rendezvous) -> Failure | None:
        """Start this node's workers; a Failure (already published) if they cannot start."""
        first, last = rdzv.rank_offset, rdzv.rank_offset + self.nproc - 1
        backend = self.backend_notes.note(rdzv.world_size, self.nproc, rdzv.fewest_local)
        self.log(
            f"starting ranks {first}..{last} of {rdzv.world_size} on node {self.node} "
            f"(generation {rdzv.generation}, worker store {self.cfg.master_addr}:"
            f"{rdzv.worker_port}{backend}"
            f", --recovery {self.cfg.recovery})"
        )
        self.check_stop()
        try:
            specs, logs = worker_specs(self.cfg, rdzv, self.secret, self.logs)
            self.workers = WorkerGroup(specs, logs)
            self.events.started(rdzv, self.workers.workers)
        except OSError as exc:
            reason = f"cannot start the workers: {exc}"
            failure = Failure(-1, -1, self.node, os.getpid(), 1, reason=reason)
            return self.store.publish_failure(rdzv.generation, failure)
        return None

    def _monitor(self, g: int) -> Failure | None:
        """Watch until every node is done (None) or some worker anywhere failed (its Failure)."""
        assert self.workers is not None
        self.store.forget_heartbeats()  # nobody beats during a rendezvous
        done = False
        while True:
            self.check_stop()
            local = self.workers.first_failure()
            if local is not None:
                # Let the pumps drain so the traceback is in the tail.
                for thread in local.threads:
                    thread.join(0.5)
                return self.store.publish_failure(g, failure_of(local, self.node))
            remote = self.store.failure(g)
            if remote is not None:
                return remote
            if not done and self.workers.all_succeeded():
                self.store.mark(g, "done")
                done = True
            if done and self.store.all_marked(g, "done"):
                return None
            if self.worker_store is not None:
                self.worker_store.check_proofs()
            self._watch_peers(g)
            time.sleep(self.cfg.monitor_interval)

    def _watch_peers(self, g: int) -> None:
        if self.node != 0:
            self.store.heartbeat()
            return
        for n in self.store.silent_nodes(self.silence):
            reason = f"{NODE_SILENT} for {self.silence:g} s"
            self.store.publish_failure(g, Failure(-1, -1, n, 0, 1, reason=reason))

    def _stop_workers(self, signum: int = signal.SIGTERM) -> None:
        if self.workers is not None:
            grace = self.cfg.shutdown_timeout
            self.workers.stop(grace, signum, hurry=lambda: len(self.signals) > 1)
            self.workers = None

    def _restart(self, g: int, failure: Failure, max_restarts: int) -> None:
        for line in describe_failure(failure):
            self.log(line)
        self.log(f"restarting all workers (restart {g + 1} of {max_restarts}, --max-restarts)")
        self._stop_workers()

    def _leave(self, g: int, timeout: float = EXIT_ACK_TIMEOUT_S) -> None:
        """Say goodbye; node 0 keeps the store up until everyone has (or a timeout)."""
        with contextlib.suppress(StoreLost):
            self.store.mark(g, "exit")
            if self.node == 0 and not self.store.wait_all_marked(g, "exit", timeout):
                self.log(f"not every node confirmed the end within {timeout:.0f} s")

    def _finish(self, g: int) -> int:
        self._leave(g)
        if self.workers is not None:
            self.workers.join_threads(timeout=2.0)
        self.events.ended(None)
        return 0

    def _fail(self, g: int, failure: Failure, max_restarts: int) -> int:
        if self.node != 0:
            self._leave(g)
        self._stop_workers()
        if self.node == 0:
            self._leave(g)
        self.events.ended(failure)
        for line in format_summary(failure, g, max_restarts):
            self.log(line)
        return failure.exit_code

    def _run_live(self) -> int:
        """One generation and one worker store; a dead worker is replaced alone."""
        if self.node != 0 and (
            formed := self.store.formed(0, self.cfg.rdzv_timeout, self.check_stop)
        ):
            return self._rejoin_live(formed)
        rdzv = self._rendezvous(0)
        failure = self._join_worker_store(rdzv) or self._start_workers(rdzv)
        if failure is None:
            assert self.workers is not None and self.worker_store is not None
            board = JobBoard(self.store.signed, rdzv.max_restarts)
            dead = self.worker_store.live
            live = LiveNode(self.workers, self.node, board, dead, self.log, self.events)
            ended = self._monitor_live(live)
            if not isinstance(ended, Failure):
                return self._end_live(ended, rdzv.max_restarts)
            failure = ended
        self.log("--recovery live replaces dead workers only: this failure ends the whole job")
        return self._fail(0, failure, rdzv.max_restarts)

    def _rejoin_live(self, rdzv: Rendezvous) -> int:
        """A relaunched agent of a running live job: its slots' workers join as replacements."""
        self.log(
            f"node {self.node}: live job {rdzv.run_id} is running; rejoining it once node 0 "
            f"has declared this node's previous agent lost ({self.silence:g} s without its "
            f"heartbeat, PHALANX_NODE_SILENCE_TIMEOUT)"
        )
        board = JobBoard(self.store.signed, rdzv.max_restarts)
        back = rejoin(self.store, board, rdzv, self.nproc, self.cfg.rdzv_timeout, self.check_stop)
        self.store.life = back.life
        if (failure := self._join_worker_store(rdzv, publish=False)) is not None:
            raise NotInJob(f"node {self.node} cannot rejoin: {failure.reason}")
        assert self.worker_store is not None
        specs, logs = worker_specs(self.cfg, rdzv, self.secret, self.logs)
        self.workers = WorkerGroup(rejoin_specs(specs, back), logs)
        self.events.started(rdzv, self.workers.workers)
        for w in self.workers.workers:
            self.log(
                f"node {self.node} rejoined: rank {w.spec.rank} (member {w.spec.env[MEMBER_ENV]}"
                f", incarnation {w.spec.env[INCARNATION_ENV]}) started as pid {w.pid}"
            )
        dead = self.worker_store.live
        events, life, carried = self.events, back.life, back.carried
        live = LiveNode(self.workers, self.node, board, dead, self.log, events, life, carried)
        ended = self._monitor_live(live)
        if isinstance(ended, Failure):
            return self._fail(0, ended, rdzv.max_restarts)
        return self._end_live(ended, rdzv.max_restarts)

    def _join_worker_store(self, rdzv: Rendezvous, publish: bool = True) -> Failure | None:
        """Nodes other than 0 connect to its worker store (to write their workers' deaths);
        a Failure (published unless told not to) if they cannot."""
        if self.worker_store is not None:  # node 0 hosts it
            return None
        timeout = timedelta(seconds=self.cfg.rdzv_timeout)
        where = (self.cfg.master_addr, rdzv.worker_port)
        try:
            self.worker_store = WorkerStore.connect(
                *where, timeout, self.store.signed.secret, rdzv.run_id, rdzv.rank_offset
            )
        except (ConnectionError, TimeoutError, JobSecretError) as exc:
            reason = f"cannot join the worker store at {where[0]}:{where[1]}: {exc}"
            failure = Failure(-1, -1, self.node, os.getpid(), 1, reason=reason)
            return self.store.publish_failure(0, failure) if publish else failure
        return None

    def _monitor_live(self, live: LiveNode) -> list[NodeOutcome] | Failure:
        """Replace dead workers until every node's workers have exited (every node's outcome),
        or until something ends the job (the first Failure)."""
        self.store.forget_heartbeats()
        assert self.worker_store is not None
        watch = NodeWatch(self.store, live.board, self.worker_store.live, self.silence, self.log)
        published = False
        while True:
            self.check_stop()
            remote = self.store.failure(0)
            if remote is not None:
                return remote
            if self.node != 0:  # before anything it writes: a dropped agent writes nothing
                self.store.heartbeat()
                check_dropped(live.board, self.node, live.life, self.silence)
            try:
                live.poll()
            except OSError as exc:
                reason = f"cannot start a replacement worker: {exc}"
                failure = Failure(-1, -1, self.node, os.getpid(), 1, reason=reason)
                return self.store.publish_failure(0, failure)
            if not published and live.all_exited():
                live.board.publish(live.outcome())
                published = True
            if published and (outcomes := live.board.outcomes(self.store.members)) is not None:
                if self.node == 0:  # the lost nodes will not say goodbye: do not wait for them
                    self.store.members = watch.members()
                return outcomes
            self.worker_store.check_proofs()
            if self.node == 0:
                watch.poll()
            time.sleep(self.cfg.monitor_interval)

    def _end_live(self, outcomes: list[NodeOutcome], max_restarts: int) -> int:
        end = verdict(outcomes, max_restarts)
        self._leave(0)
        if self.workers is not None:
            self.workers.join_threads(timeout=2.0)
        self.events.ended(end.failure)
        for line in end.lines:
            self.log(line)
        return end.exit_code

    def _stopped_by_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self.log(f"received {name}; stopping the workers (forwarding {name})")
        failure = Failure(-1, -1, self.node, os.getpid(), -signum, reason=f"received {name}")
        with contextlib.suppress(StoreLost):
            self.store.publish_failure(self.generation, failure)
        self._stop_workers(signum)
        self.events.ended(failure)
        if self.cfg.nnodes > 1:
            self._leave(self.generation, timeout=STOP_GRACE_S)
        return 128 + signum
