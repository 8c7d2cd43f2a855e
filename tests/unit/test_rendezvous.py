"""The agents' protocol over one in-process store: rendezvous, failures, marks, heartbeats.

Every value is signed; a stranger (raw writes, no secret) can neither join, stop, finish nor keep
a node alive, and a node with another job's secret fails at once naming the job and the store.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from phalanx.launch.args import parse_args
from phalanx.launch.rendezvous import AgentStore, RendezvousError
from phalanx.launch.run import _warn_without_secret
from phalanx.launch.summary import Failure

SECRET = b"s" * 64
NOW = lambda: None  # noqa: E731  (check_stop)


def _agents(nnodes: int, secret: bytes | None = SECRET) -> tuple[dist.Store, list[AgentStore]]:
    store = dist.HashStore()
    agents = [AgentStore(store, n, nnodes, lambda _: None, secret=secret) for n in range(nnodes)]
    return store, agents


def _join(node: AgentStore, nproc: int) -> None:
    """What ``rendezvous`` writes for a non-zero node before it waits."""
    node._read_config(1, NOW)
    node._claim_node_rank(0)
    node._put(node._key(0, "nproc", node.node_rank), {"nproc": nproc, "host": "h"})


def test_rendezvous_rank_offsets_are_prefix_sums() -> None:
    _, (node0, node1, node2) = _agents(3)
    node0.publish_config("run1", 2)
    _join(node1, 3)
    _join(node2, 1)
    rdzv = node0.rendezvous(0, 2, 4242, timeout=1, check_stop=NOW)
    assert (rdzv.rank_offset, rdzv.world_size, rdzv.worker_port) == (0, 6, 4242)
    assert (rdzv.run_id, rdzv.max_restarts) == ("run1", 2)
    rdzv2 = node2.rendezvous(0, 1, None, timeout=1, check_stop=NOW)
    assert (rdzv2.rank_offset, rdzv2.world_size, rdzv2.worker_port) == (5, 6, 4242)


def test_rendezvous_keys_are_namespaced_by_generation() -> None:
    _, (node0, node1) = _agents(2)
    node0.publish_config("r", 1)
    _join(node1, 1)
    node0.rendezvous(0, 1, 1111, timeout=1, check_stop=NOW)
    with pytest.raises(RendezvousError, match=r"nodes \[1\] did not join"):
        node0.rendezvous(1, 1, 2222, timeout=0.1, check_stop=NOW)


def test_a_strangers_join_record_is_not_a_node() -> None:
    store, (node0, _) = _agents(2)
    node0.publish_config("r", 1)
    store.set(node0._key(0, "nproc", 1), '{"nproc": 7, "host": "evil"}')  # unsigned, unframed
    with pytest.raises(RendezvousError, match=r"nodes \[1\] did not join"):
        node0.rendezvous(0, 1, 1111, timeout=0.2, check_stop=NOW)


@pytest.mark.parametrize("theirs", [b"t" * 64, None])
def test_a_node_with_another_secret_fails_at_once_naming_the_job(theirs: bytes | None) -> None:
    store, (node0, _) = _agents(2)
    node0.publish_config("job-42", 0)
    stranger = AgentStore(store, 1, 2, lambda _: None, secret=theirs, where="10.0.0.1:29500")
    start = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        stranger.rendezvous(0, 1, None, timeout=60, check_stop=NOW)
    assert time.monotonic() - start < 1
    message = str(err.value)
    assert "cannot join job 'job-42' at the rendezvous store 10.0.0.1:29500" in message
    assert "set the same PHALANX_JOB_SECRET on every node" in message
    assert ("HMAC does not match" if theirs else "PHALANX_JOB_SECRET is not set") in message


def test_duplicate_node_rank_fails_everyone_but_a_strangers_claim_does_not() -> None:
    store, (node0, node1) = _agents(2)
    node0.publish_config("r", 0)
    node1._read_config(1, NOW)
    store.set(node1._key(0, "joined", 1), "junk")  # a stranger's claim: replaced
    node1._claim_node_rank(0)
    twin = AgentStore(store, 1, 2, lambda _: None, secret=SECRET)
    with pytest.raises(RendezvousError, match=r"two agents joined as node 1 \(the other on"):
        twin.rendezvous(0, 1, None, timeout=1, check_stop=NOW)
    failure = node0.failure(0)
    assert failure is not None and failure.rank == -1 and "--node-rank" in str(failure.reason)


def test_first_published_failure_wins_and_forged_ones_do_not_count() -> None:
    store, (node0, node1) = _agents(2)
    node0.publish_config("r", 0)
    node1._read_config(1, NOW)
    key = node0._key(0, "failure")
    forged = Failure(1, 1, 0, 11, 1, exception="Forged: by a stranger").to_json()
    for junk in (forged, "phx1 - " + forged, "phx1 " + "ab" * 32 + " " + forged, "\xff{"):
        store.set(key, junk)
        assert node0.failure(0) is None and node1.failure(0) is None  # never a crash
    first = Failure(1, 1, 0, 11, 1, exception="ValueError: boom")
    assert node0.publish_failure(0, first) == first  # the junk is replaced, not "first"
    assert node1.publish_failure(0, Failure(2, 0, 1, 22, -9)) == first
    assert node1.failure(0) == first and node1.failure(1) is None


def test_a_failure_replayed_into_another_generation_is_refused() -> None:
    store, (node0, _) = _agents(2)
    node0.publish_config("r", 0)
    node0.publish_failure(0, Failure(1, 1, 0, 11, 1))
    store.set(node0._key(1, "failure"), store.get(node0._key(0, "failure")))
    assert node0.failure(1) is None


def test_done_marks_and_silent_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    store, (node0, node1) = _agents(2)
    node0.publish_config("r", 0)
    node1._read_config(1, NOW)
    node0.mark(0, "done")
    store.set(node0._key(0, "done", 1), "1")  # a stranger finishing node 1's work
    assert not node0.all_marked(0, "done")
    node1.mark(0, "done")
    assert node0.all_marked(0, "done")
    clock = [100.0]
    monkeypatch.setattr("phalanx.launch.rendezvous.time.monotonic", lambda: clock[0])
    node1.heartbeat()
    assert node0.silent_nodes(30) == []
    clock[0] += 20
    node1.heartbeat()
    assert node0.silent_nodes(30) == []
    old_beat = store.get("phalanx/heartbeat/1")
    node1.heartbeat()  # clock unchanged: at most one beat a second, so no new one
    clock[0] += 31
    store.set("phalanx/heartbeat/1", old_beat)  # a replayed beat keeps nobody alive
    assert node0.silent_nodes(30) == [1]
    store.set("phalanx/heartbeat/1", "999")  # nor does a forged one
    clock[0] += 1
    assert node0.silent_nodes(30) == [1]


def test_without_a_secret_values_are_framed_and_junk_is_refused() -> None:
    store, (node0, node1) = _agents(2, secret=None)
    node0.publish_config("r", 0)
    node1._read_config(1, NOW)
    assert store.get("phalanx/config").startswith(b"phx1 - ")
    store.set(node0._key(0, "failure"), "not json")
    assert node1.failure(0) is None
    store.set(node0._key(0, "failure"), 'phx1 - {"rank": "x"}')  # framed, wrong shape
    assert node1.failure(0) is None


def test_the_launcher_warns_once_without_a_secret_on_a_reachable_master() -> None:
    cfg = parse_args(["--nnodes", "2", "--master-addr", "10.0.0.5", "x.py"])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PHALANX_JOB_SECRET", raising=False)
        lines: list[str] = []
        mp.setattr("phalanx.launch.run._log", lines.append)
        _warn_without_secret(cfg, ["10.0.0.5"])
        _warn_without_secret(cfg, ["127.0.0.1"])  # loopback: only this machine
        _warn_without_secret(parse_args(["x.py"]), ["10.0.0.5"])  # one node: the launcher's own
        mp.setenv("PHALANX_JOB_SECRET", "3" * 64)
        _warn_without_secret(cfg, ["10.0.0.5"])
    assert len(lines) == 1
    assert "PHALANX_JOB_SECRET is not set" in lines[0] and "10.0.0.5:29500" in lines[0]
