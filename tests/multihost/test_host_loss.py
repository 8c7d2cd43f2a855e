"""A host lost in the middle of training, under each recovery: the job goes on without it
(``--nnodes MIN:MAX``), or takes it back when the same command runs there again (restart mode).

Each job trains ``scripts/elastic_job.py`` (DDP, a checkpoint in the middle of every epoch) on
2 namespace hosts x 2 workers; the lost host's launcher and workers are SIGKILLed together, as a
machine that disappears.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS
from tests.multihost.hosts import start_on, stop

pytestmark = pytest.mark.netns

ELASTIC = str(SCRIPTS / "elastic_job.py")


def _wait_for_checkpoint(ckpt: Path, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + scaled(60)
    while not list(ckpt.glob("step-*")):  # training (at world size 4) has saved once
        for p in procs:
            assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 60 s"
        time.sleep(0.05)


def test_node_loss_continues_on_the_remaining_node(two_hosts: Hosts, tmp_path: Path) -> None:
    # --nnodes 1:2: when node 1 disappears (its launcher and workers SIGKILLed), node 0's
    # workers fail, node 0 restarts, closes the next rendezvous with itself alone after the
    # last call, and resumes from the newest checkpoint, saved mid-epoch at world 4, at world
    # size 2 with ranks 0..1, finishing that epoch (before: "cannot resume mid-epoch").
    ckpt = tmp_path / "ckpt"
    common = [
        *("--nnodes", "1:2", "--nproc-per-node", "2", "--master-addr", two_hosts.addr[0]),
        *("--master-port", "29563", "--rdzv-timeout", "30", "--max-restarts", "1"),
    ]
    procs = [
        start_on(two_hosts, 0, *common, "--node-rank", "0", ELASTIC, str(ckpt)),
        start_on(two_hosts, 1, *common, "--node-rank", "1", ELASTIC, str(ckpt)),
    ]
    try:
        _wait_for_checkpoint(ckpt, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the machine disappears
        out, err = procs[0].communicate(timeout=scaled(120))
    finally:
        for p in procs:
            stop(p)
    assert procs[0].returncode == 0, out + err
    assert "[rank 0] GEN 0 WORLD 4" in out and "[rank 0] GEN 1 WORLD 2" in out
    assert "generation 1 starts with nodes [0]" in err
    step, epoch = map(int, re.findall(r"resumed from \S+ \(step (\d+), epoch (\d+)\)", err)[0])
    assert step == 2 * epoch + 1, err  # after the 1st of the epoch's 2 steps at world 4
    assert "[rank 0] DONE WORLD 2 STEPS" in out
    assert "default backend shm (hierarchical: shared memory inside each machine" in err, err
    assert "default backend shm (CPU ranks on one machine; --backend gloo opts out)" in err, err


def test_a_rebooted_host_rejoins_in_restart_mode(two_hosts: Hosts, tmp_path: Path) -> None:
    # A fixed --nnodes 2 with a restart left: node 1's machine disappears, node 0's workers
    # fail and node 0 starts generation 1; the same command run again on node 1 (its previous
    # agent's claim of node 1 in generation 0 is a dead pid of this host, not a twin) joins
    # generation 1, and the job ends at world 4. Before, it failed as "two agents joined as
    # node 1", and node 0 timed out waiting for node 1.
    ckpt = tmp_path / "ckpt"
    common = [
        *("--nnodes", "2", "--nproc-per-node", "2", "--master-addr", two_hosts.addr[0]),
        *("--master-port", "29566", "--rdzv-timeout", "60", "--max-restarts", "1"),
    ]
    node1 = [*common, "--node-rank", "1", ELASTIC, str(ckpt)]
    procs = [
        start_on(two_hosts, 0, *common, "--node-rank", "0", ELASTIC, str(ckpt)),
        start_on(two_hosts, 1, *node1),
    ]
    try:
        _wait_for_checkpoint(ckpt, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the machine disappears...
        procs[1].communicate(timeout=scaled(30))
        procs.append(start_on(two_hosts, 1, *node1))  # ...and comes back
        out0, err0 = procs[0].communicate(timeout=scaled(120))
        out1, err1 = procs[2].communicate(timeout=scaled(60))
    finally:
        for p in procs:
            stop(p)
    assert procs[0].returncode == 0, out0 + err0
    assert procs[2].returncode == 0, out1 + err1
    assert "[rank 0] GEN 1 WORLD 4" in out0 and "[rank 0] DONE WORLD 4 STEPS" in out0, out0
    assert "restarting all workers (restart 1 of 1" in err0, err0
    assert "starting ranks 2..3 of 4 on node 1 (generation 1" in err1, err1
    assert "two agents" not in err0 + err1
    assert "resumed from" in out0 + err0
