"""Training across hosts gives one host's numbers: DDP and ZeRO-3 on 2 namespace hosts x 2
workers end with exactly the parameters of 1 host x 4 (gloo on both, ``train_digest.py``).

The reference runs at the same time on a third host, so the test costs one job's time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS
from tests.multihost.hosts import start_on, stop

pytestmark = pytest.mark.netns

SCRIPT = str(SCRIPTS / "train_digest.py")


@pytest.mark.parametrize(
    "strategy",
    # ZeRO across hosts in make test: test_hybrid_shard.py (hybrid ZeRO-3 against one host)
    ["ddp", pytest.param("zero3", marks=pytest.mark.extended)],
)
def test_two_hosts_train_as_one(three_hosts: Hosts, tmp_path: Path, strategy: str) -> None:
    spread, alone = tmp_path / "spread.json", tmp_path / "alone.json"
    common = ["--nproc-per-node", "2", "--backend", "gloo", "--rdzv-timeout", "60"]
    master = ["--nnodes", "2", "--master-addr", three_hosts.addr[0], "--master-port", "29568"]
    job = [SCRIPT, strategy, str(spread)]
    procs = [
        start_on(three_hosts, 0, *common, *master, "--node-rank", "0", *job),
        start_on(three_hosts, 1, *common, *master, "--node-rank", "1", *job),
        start_on(
            three_hosts,
            2,
            "--standalone",
            "--nproc-per-node",
            "4",
            "--backend",
            "gloo",
            SCRIPT,
            strategy,
            str(alone),
        ),
    ]
    try:
        outs = [p.communicate(timeout=scaled(150)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    assert "starting ranks 2..3 of 4 on node 1" in outs[1][1]
    two, one = json.loads(spread.read_text()), json.loads(alone.read_text())
    assert two["world"] == one["world"] == 4 and two["steps"] == one["steps"] == 32
    assert two["params"] == one["params"]  # bit for bit
