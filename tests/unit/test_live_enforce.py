"""``--recovery live``: the agent kills the workers the job declared dead, and stopped ones
(issue 34: a SIGSTOPped worker was waited on forever and never replaced). Only a signed death
record counts; a forged or junk one is ignored."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.launch import live_keys
from phalanx.launch.live import JobBoard, LiveNode
from phalanx.launch.live_enforce import STOPPED_GRACE_S, stopped
from phalanx.launch.live_outcome import NodeOutcome, verdict
from phalanx.launch.logs import StreamLogs, WorkerLogs
from phalanx.launch.workers import WorkerGroup, WorkerSpec

SECRET = b"k" * 32
DEADLINE_S = 60.0
# The first process of the slot runs CODE; its replacement exits 0 at once.
FIRST_ONLY = "import os, sys; os.environ['PHALANX_INCARNATION'] == '0' or sys.exit(0); "


def _node(code: str, max_replacements: int = 1) -> tuple[LiveNode, list[str]]:
    env = {**live_keys.live_env(0, 0), "PATH": "/usr/bin:/bin"}
    quiet = WorkerLogs(StreamLogs(None, console=False), StreamLogs(None, console=False))
    spec = WorkerSpec(0, 0, [sys.executable, "-c", FIRST_ONLY + code], env, logs=quiet)
    store, lines = dist.HashStore(), list[str]()
    board = JobBoard(SignedStore(store, SECRET, "agent/n"), max_replacements)
    dead = live_keys.live_signer(store, SECRET, "n")
    return LiveNode(WorkerGroup([spec]), 0, board, dead, lines.append), lines


def _until(node: LiveNode, done: object) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            node.workers.stop(grace=0.0)
            raise AssertionError(f"not done within {DEADLINE_S} s")
        node.poll()
        time.sleep(0.02)


def _outcome(node: LiveNode) -> NodeOutcome:
    _until(node, node.all_exited)
    node.workers.join_threads(timeout=5.0)
    return node.outcome()


def test_a_worker_the_job_declared_dead_is_killed_and_replaced() -> None:
    node, lines = _node("import time; print('up', flush=True); time.sleep(600)")
    first = node.workers.workers[0]
    live_keys.report_death(node.dead, "0.0", 0)  # a survivor's heartbeat check, say
    outcome = _outcome(node)
    assert first.returncode == -9
    [death] = outcome.deaths
    assert (death.member, death.incarnation, death.replaced) == ("0.0", 0, True)
    assert death.failure.reason is not None
    assert death.failure.reason.startswith("killed by its agent (SIGKILL): the job declared it")
    assert "phalanx/live/dead/0.0" in lines[0] and "killing it (SIGKILL)" in lines[0]
    assert outcome.finished == ["0.0"]  # the replacement ran to the end
    assert verdict([outcome], 1).exit_code == 0


def test_a_forged_or_junk_death_record_kills_nobody() -> None:
    node, lines = _node("import time; time.sleep(600)")
    store = node.dead.store
    forged = live_keys.live_signer(store, b"x" * 32, "n")  # another secret: a stranger's
    try:
        for value in ("junk", "phx1 - 0", forged.encode("dead/0.0", 0)):
            store.set("phalanx/live/dead/0.0", value)
            for _ in range(5):
                node.poll()
        assert node.workers.running() and lines == []
    finally:
        node.workers.stop(grace=0.0)


def test_a_stopped_worker_is_killed_after_the_grace_and_named() -> None:
    node, lines = _node("import os, signal; os.kill(os.getpid(), signal.SIGSTOP)")
    first = node.workers.workers[0]
    _until(node, lambda: stopped(first.pid))
    node.poll()
    assert node.workers.running(), f"killed at first sight, not after {STOPPED_GRACE_S} s"
    outcome = _outcome(node)
    [death] = outcome.deaths
    assert death.replaced and death.failure.returncode == -9
    assert "it was stopped (SIGSTOP or SIGTSTP) for" in (death.failure.reason or "")
    assert "it was stopped" in lines[0]
    assert "replaced by pid" in lines[1]
