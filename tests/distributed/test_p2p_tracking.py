"""Point-to-point operations leave flight records on their own channel, closed however they are
consumed, and only a wait on a named peer can be a hang (the rule of ``phalanx.comm.p2p``)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

import phalanx
from phalanx.comm import p2p
from phalanx.diagnostics import tracking
from phalanx.diagnostics.flight import FlightRecorder
from phalanx.diagnostics.pairing import first_divergence
from phalanx.parameter_server import wire
from phalanx.parameter_server.protocol import Kind, encode_header
from phalanx.testing import run_distributed

THRESHOLD = 1.5
ENV = {"PHALANX_HANG_TIMEOUT": str(THRESHOLD)}


def _records() -> list[Any]:
    recorder = tracking.recorder()
    assert recorder is not None
    return recorder.records()


def _exchange() -> dict[str, Any]:
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    t = torch.full((3,), float(rank))
    phalanx.all_reduce(t)
    ops = {}
    if rank == 0:
        p2p.send(torch.ones(2, 5), 1)
        p2p.isend(torch.ones(4), 1).wait()
        wire.send(encode_header(Kind.HEARTBEAT, worker=0), 1, dist.group.WORLD)
    else:
        ops["recv_from"] = p2p.recv(torch.empty(2, 5))  # any source: returns the sender
        p2p.irecv(torch.empty(4), 0).wait()
        wire.receive(0, dist.group.WORLD, idle=True)
    batch = [
        dist.P2POp(dist.isend, t, peer, tag=7),
        dist.P2POp(dist.irecv, torch.empty(3), peer, tag=7),
    ]
    for work in p2p.batch_isend_irecv(batch):
        work.wait()
    phalanx.all_reduce(t)
    ops["records"] = [asdict(r) for r in _records()]
    return ops


def test_p2p_records_complete_on_their_own_channel() -> None:
    results = run_distributed(_exchange, world_size=2)
    assert results[1]["recv_from"] == 0
    mine = [[r for r in res["records"] if r["peer"] is not None] for res in results]
    for res, p2p_recs in zip(results, mine):
        collectives = [r for r in res["records"] if r["peer"] is None]
        # P2P never moves the collectives' numbers: the two all-reduces are #1 and #2.
        assert [(r["op"], r["seq"]) for r in collectives] == [("all_reduce", 1), ("all_reduce", 2)]
        assert all(r["end"] is not None for r in res["records"]), "every record completed"
        assert {r["group"] for r in p2p_recs} == {"p2p"}
        assert all("test_p2p_tracking.py" in r["site"] for r in p2p_recs), p2p_recs
    send_side = [(r["op"], r["peer"], r["shape"], r["idle"]) for r in mine[0]]
    recv_side = [(r["op"], r["peer"], r["shape"], r["idle"]) for r in mine[1]]
    assert send_side == [
        ("send", 1, "[2, 5] float32", False),
        ("send", 1, "[4] float32", False),
        ("send", 1, "[13] int64", False),  # the wire's header and its MAC slot
        ("send", 1, "[3] float32", False),  # the batch
        ("recv", 1, "[3] float32", False),
    ]
    assert recv_side == [
        ("recv", -1, "[2, 5] float32", True),  # from any rank: idle by the rule
        ("recv", 0, "[4] float32", False),
        ("recv", 0, "[13] int64", True),  # a server's wait for a request
        ("send", 0, "[3] float32", False),
        ("recv", 0, "[3] float32", False),
    ]
    # A send and its receive differ by design: never a divergence.
    recorders = {}
    for rank, res in enumerate(results):
        recorders[rank] = FlightRecorder()
        for r in res["records"]:
            recorders[rank].start(
                r["group"], r["seq"], r["op"], r["shape"], r["site"], peer=r["peer"]
            )
    assert first_divergence({k: v.records() for k, v in recorders.items()}) is None


def _long_but_legitimate_waits() -> list[str]:
    """Three waits longer than the threshold, none of them a hang."""
    if dist.get_rank() == 0:
        time.sleep(THRESHOLD + 1.0)
        p2p.send(torch.ones(1), 1, tag=2)
        time.sleep(THRESHOLD + 1.0)
        p2p.send(torch.ones(1), 1, tag=3)
        p2p.send(torch.ones(1), 1, tag=1)
    else:
        ahead = p2p.irecv(torch.empty(1), 0, tag=1)  # posted ahead, waited for at the end
        p2p.recv(torch.empty(1), None, tag=2)  # from any rank
        p2p.recv(torch.empty(1), 0, tag=3, idle=True)  # marked idle by its caller
        ahead.wait()
    time.sleep(0.6)  # one more watchdog tick
    return tracking.hang_reports()


def test_idle_and_posted_ahead_waits_are_not_hangs() -> None:
    assert run_distributed(_long_but_legitimate_waits, world_size=2, env=ENV) == [[], []]
