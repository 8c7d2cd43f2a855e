"""Hybrid sharding across two namespace hosts: ``phalanx.Zero(stage=3, shard="host")``.

Each host runs ``phalanx run`` with 2 workers: the shards live inside each host (on shared
memory) and each gradient shard is all-reduced with its twin on the other host (gloo over the
bridge, each link capped at 100 Mbit/s). After 3 steps the parameters equal one process's within
1e-5 (floating-point reassociation of the mean); the checkpoint the job saved then loads on one
host of 2 ranks, exactly, in one process (another host count: the pieces come from the first
host's ranks; ``tests/distributed/test_zero_hybrid.py`` reloads at 1 x 4, 4 x 1 and 1 x 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS
from tests.multihost.hosts import start_on, stop
from tests.script_module import load_script

pytestmark = pytest.mark.netns

SCRIPT = SCRIPTS / "hybrid_shard_job.py"


def _run(hosts: Hosts, nodes: list[list[str]], *job: str) -> list[str]:
    """One launcher per entry of ``nodes`` (its host and launcher flags); their stdouts."""
    procs = []
    try:
        for host, *flags in nodes:
            procs.append(start_on(hosts, int(host), *flags, str(SCRIPT), *job))
        outs = [p.communicate(timeout=scaled(120)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
    return [out for out, _ in outs]


def test_hybrid_zero3_across_two_hosts_then_resumed_on_one(
    two_hosts_100mbit: Hosts, tmp_path: Path
) -> None:
    two_hosts = two_hosts_100mbit
    ckpt, addr = str(tmp_path / "ckpt"), two_hosts.addr[0]
    node = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", addr]
    node += ["--master-port", "29563", "--rdzv-timeout", "60"]
    outs = _run(
        two_hosts,
        [["1", *node, "--node-rank", "1"], ["0", *node, "--node-rank", "0"]],
        str(tmp_path),
        ckpt,
        "host",
    )
    layout = "2 hosts x 2 ranks: shard on shm inside each host, replicate on gloo across hosts"
    assert f"node 1: {layout}; shard ranks [2, 3]" in outs[0], outs[0]
    assert f"node 0: {layout}; shard ranks [0, 1]" in outs[1], outs[1]
    trained = torch.load(tmp_path / "train-4.pt", weights_only=True)
    script = load_script(SCRIPT, "hybrid_shard_job")
    want = script.reference()
    assert list(trained) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)

    # One process on this machine (1 host x 1 rank) loads it: every piece from host 0's ranks.
    net = script.model()
    opt = script.optimizer(net.parameters())
    info = phalanx.checkpoint.load(ckpt, model=net, optimizer=opt, rng=False)
    assert info is not None and (info.step, info.world_size) == (script.STEPS, 4)
    for key, value in trained.items():
        assert torch.equal(net.state_dict()[key], value), key
    assert [int(s["step"]) for s in opt.state.values()] == [script.STEPS] * 6
