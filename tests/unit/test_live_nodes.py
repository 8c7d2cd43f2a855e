"""Losing and regaining a node under ``--recovery live`` (:mod:`phalanx.launch.live_nodes`),
over one in-memory store: node 0's watch, a relaunched agent's rejoin, a slow agent dropped."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from phalanx.launch import live_keys
from phalanx.launch.live import JobBoard
from phalanx.launch.live_nodes import NodeWatch, NotInJob, check_dropped, rejoin, rejoin_specs
from phalanx.launch.live_outcome import NodeOutcome, verdict
from phalanx.launch.rendezvous import AgentStore
from phalanx.launch.workers import WorkerSpec

SECRET = b"s" * 64
NOW = lambda: None  # noqa: E731  (check_stop)


def _job(monkeypatch: pytest.MonkeyPatch, budget: int = 2) -> tuple[dist.Store, list[float]]:
    """A 2-node x 2-worker live job whose generation 0 is closed; the agents' clock."""
    store = dist.HashStore()
    node0 = AgentStore(store, 0, 2, lambda _: None, secret=SECRET)
    node0.publish_config("run", budget)
    for n in (0, 1):
        node0._put(node0._key(0, "nproc", n), {"nproc": 2, "host": "h"})
    node0._put(node0._key(0, "members"), [0, 1])
    node0._put(node0._key(0, "worker_port"), 1234)
    clock = [100.0]
    monkeypatch.setattr("phalanx.launch.rendezvous.time.monotonic", lambda: clock[0])
    return store, clock


def _watch(store: dist.Store, lines: list[str]) -> NodeWatch:
    node0 = AgentStore(store, 0, 2, lambda _: None, secret=SECRET)
    node0._read_config(1, NOW)
    assert node0.config is not None
    board = JobBoard(node0.signed, node0.config.max_restarts)
    dead = live_keys.live_signer(store, SECRET, "nonce")
    return NodeWatch(node0, board, dead, 5.0, lines.append)


def _lose_node_1(watch: NodeWatch, clock: list[float]) -> None:
    watch.poll()  # node 1's heartbeat is first seen (absent: 0)
    clock[0] += 6.0
    watch.poll()


def test_a_silent_node_is_a_loss_of_its_workers_and_the_job_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock = _job(monkeypatch)
    lines: list[str] = []
    watch = _watch(store, lines)
    watch.board.claim_replacement("1.1")  # slot 1.1 runs its incarnation 1
    _lose_node_1(watch, clock)
    assert live_keys.dead_incarnation(watch.dead, "1.0") == 0
    assert live_keys.dead_incarnation(watch.dead, "1.1") == 1
    assert len(lines) == 2 and "node 1 lost" in lines[0] and "rank 2 (member 1.0" in lines[0]
    assert "run the same `phalanx run` command on node 1 again" in lines[1]
    assert watch.members() == [0] and watch.board.lost_life(1) == 0
    watch.poll()  # still silent: declared once
    assert len(lines) == 2
    watch.board.publish(NodeOutcome(1, ["1.0", "1.1"], []))  # a slow agent's, too late
    lost = watch.board.outcome(1, 0)
    assert lost is not None and lost.finished == [] and len(lost.deaths) == 2
    node0_end = NodeOutcome(0, ["0.0", "0.1"], [])
    assert watch.board.outcomes([0, 1]) is None  # node 0's own outcome is not out yet
    watch.board.publish(node0_end)
    end = verdict(watch.board.outcomes([0, 1]) or [], 2)
    assert end.exit_code == 1 and "2 of 4 workers ran to the end" in end.lines[0]  # lost: fails
    expected = "lost: rank 3 (member 1.1, incarnation 1, pid 0): node 1 lost: no heartbeat from"
    assert any(expected in line for line in end.lines), end.lines


def test_a_relaunched_agent_rejoins_with_replacements_and_the_old_one_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock = _job(monkeypatch)
    lines: list[str] = []
    watch = _watch(store, lines)
    node1 = AgentStore(store, 1, 2, lambda _: None, secret=SECRET)
    rdzv = node1.formed(0, 1, NOW)
    assert rdzv is not None and (rdzv.rank_offset, rdzv.world_size, rdzv.worker_port) == (
        2,
        4,
        1234,
    )
    board = JobBoard(node1.signed, rdzv.max_restarts)
    tick = lambda: clock.__setitem__(0, clock[0] + 1.0)  # noqa: E731  (time passes)
    with pytest.raises(NotInJob, match="still counts its previous agent"):
        rejoin(node1, board, rdzv, 2, 3.0, tick)  # node 0 has not declared it lost yet
    _lose_node_1(watch, clock)
    back = rejoin(node1, board, rdzv, 2, 1.0, NOW)
    assert back.life == 1 and back.incarnations == {0: 1, 1: 1}
    assert [(d.member, d.replaced) for d in back.carried] == [("1.0", True), ("1.1", True)]
    check_dropped(board, 1, back.life, 5.0)  # the new agent counts
    with pytest.raises(NotInJob, match="node 0 declared node 1 lost"):
        check_dropped(board, 1, 0, 5.0)  # the slow old one is told it was dropped
    watch.poll()
    assert watch.members() == [0, 1] and "node 1 is back" in lines[-1]
    assert watch.store.lives == {1: 1}
    node1.life = back.life
    node1.heartbeat()  # its own key: the old life's beats say nothing about it
    assert store.check(["phalanx/heartbeat/1/life1"])
    watch.board.publish(NodeOutcome(0, ["0.0", "0.1"], []))
    assert watch.board.outcomes([0, 1]) is None  # the life-0 outcome no longer counts
    watch.board.publish(NodeOutcome(1, ["1.0", "1.1"], back.carried, back.life))
    end = verdict(watch.board.outcomes([0, 1]) or [], 2)
    assert end.exit_code == 0 and "4 of 4 workers ran to the end" in end.lines[0]
    specs = [WorkerSpec(2 + i, i, ["x"], live_keys.live_env(1, i), False) for i in range(2)]
    assert [s.env["PHALANX_INCARNATION"] for s in rejoin_specs(specs, back)] == ["1", "1"]


def test_with_no_replacement_left_a_relaunched_agent_leaves_the_job_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock = _job(monkeypatch, budget=1)
    watch = _watch(store, [])
    watch.board.claim_replacement("0.0")  # the whole budget is used
    _lose_node_1(watch, clock)
    node1 = AgentStore(store, 1, 2, lambda _: None, secret=SECRET)
    rdzv = node1.formed(0, 1, NOW)
    assert rdzv is not None
    board = JobBoard(node1.signed, rdzv.max_restarts)
    with pytest.raises(NotInJob, match=r"no replacement left \(1 of 1 used, --max-restarts\)"):
        rejoin(node1, board, rdzv, 2, 1.0, NOW)
    assert board.life(1) == 0 and watch.members() == [0]  # nothing claimed, nothing changed
