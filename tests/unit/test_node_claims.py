"""Who is which node (``launch/node_claims.py``), over one in-process store.

Agents started without ``--node-rank`` take distinct ranks; a rank held by a dead agent of this
host (a relaunch) is taken back, one held by a live agent is not; junk at a claim key does not
block anyone; with more agents than ``--nnodes`` the error names who holds each rank. In a
generation, a twin (live) fails the rendezvous, a previous life of this host does not.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.launch.agent_values import Claim
from phalanx.launch.node_claims import (
    AUTO_KEY,
    NoNodeRank,
    PreviousLife,
    is_previous_life,
    take_node_rank,
)
from phalanx.launch.rendezvous import AgentStore, RendezvousError

SECRET = b"k" * 64


def _signed() -> SignedStore:
    return SignedStore(dist.HashStore(), SECRET, "agent/n1")


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def _take(signed: SignedStore, token: str, nnodes: int = 3, timeout: float = 0.2) -> int:
    return take_node_rank(signed, nnodes, token, timeout, lambda: None, "10.0.0.1:29400")


def test_agents_without_node_ranks_take_distinct_ones() -> None:
    signed = _signed()
    assert [_take(signed, t) for t in ("a", "b")] == [1, 2]
    assert _take(signed, "a") == 1  # asking again: the same rank


def test_junk_at_a_claim_key_blocks_nobody() -> None:
    signed = _signed()
    signed.store.set(AUTO_KEY.format(1), b"\xffjunk")  # type: ignore[arg-type]
    assert _take(signed, "a") == 1


def test_a_dead_agent_of_this_host_gives_its_rank_back_a_live_one_does_not() -> None:
    signed = _signed()
    host = socket.gethostname()
    signed.put(AUTO_KEY.format(1), {"token": "old", "host": host, "pid": _dead_pid()})
    signed.put(AUTO_KEY.format(2), {"token": "other", "host": host, "pid": os.getppid()})
    assert _take(signed, "new") == 1  # the relaunch of node 1 (its agent's pid is gone)
    with pytest.raises(NoNodeRank) as caught:
        _take(signed, "third")
    message = str(caught.value)
    assert "no node rank is free at the rendezvous store 10.0.0.1:29400" in message
    assert f"node 1: {host} pid {os.getpid()}; node 2: {host} pid {os.getppid()}" in message
    assert "raise --nnodes or stop the extra agent" in message


def test_a_claim_from_another_host_is_never_a_previous_life() -> None:
    assert not is_previous_life(Claim("x", "elsewhere", _dead_pid()), "mine")
    assert is_previous_life(Claim("x", socket.gethostname(), _dead_pid()), "mine")
    assert not is_previous_life(Claim("x", socket.gethostname(), os.getpid()), "mine")


def test_in_a_generation_a_twin_fails_and_a_previous_life_waits() -> None:
    store = dist.HashStore()
    node0 = AgentStore(store, 0, 2, lambda _: None, secret=SECRET)
    node0.publish_config("run", 1)
    old, new = (AgentStore(store, 1, 2, lambda _: None, secret=SECRET) for _ in range(2))
    old.config = new.config = None
    old._read_config(1, lambda: None)
    new._read_config(1, lambda: None)
    old._claim_node_rank(0)
    with pytest.raises(RendezvousError, match="two agents joined as node 1"):
        new._claim_node_rank(0)  # the old agent (this process) lives: a twin
    key = old._key(1, "joined", 1)
    old.signed.put(key, {"token": "gone", "host": socket.gethostname(), "pid": _dead_pid()})
    with pytest.raises(PreviousLife) as caught:
        new._claim_node_rank(1)
    assert caught.value.generation == 1
    node0.publish_generation(2)
    assert new.wait_generation(1, 1, lambda: None) == 2
