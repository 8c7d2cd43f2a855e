"""``phalanx run --recovery live`` on two namespace hosts (``bench.hosts``): a node is lost, the
job goes on at the smaller world, and the node's relaunched agent rejoins it (issue 19).

2 nodes x 2 workers train ``scripts/live_job.py`` (DDP, ``recovery="live-exact"``, 3 epochs of
20 steps). At step 10 a worker of node 1 SIGKILLs its agent's process group and itself: the
whole node vanishes. Node 0 declares it lost after ``PHALANX_NODE_SILENCE_TIMEOUT`` (5 s), its
workers go on at world 2 in their own processes, and the same command run again on node 1
rejoins: its two workers are replacements (incarnation 1) that the job admits. Every member
ends at step 60 at world 4 with a clean ledger and the fault-free run's parameters, bit for bit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.live_runs import LIVE_SCRIPT, check_records, live_job
from tests.multihost.hosts import start_on, stop

pytestmark = [pytest.mark.netns, pytest.mark.timeout(400)]

ENV = {"PHALANX_NODE_SILENCE_TIMEOUT": "5", "PHALANX_JOB_SECRET": "ab" * 32}


def test_a_lost_node_is_a_loss_of_its_workers_and_its_relaunched_agent_rejoins(
    two_hosts: Hosts, tmp_path: Path
) -> None:
    folder = tmp_path / "nodes"
    folder.mkdir()
    common = [
        *("--nnodes", "2", "--nproc-per-node", "2", "--master-addr", two_hosts.addr[0]),
        *("--master-port", "29565", "--rdzv-timeout", "30"),
        *("--recovery", "live", "--max-restarts", "2"),
    ]
    script = [LIVE_SCRIPT, str(folder), "2@10@node", "0.05", "live-exact"]
    node1 = [*common, "--node-rank", "1", *script]
    start = time.monotonic()
    procs = [
        start_on(two_hosts, 0, *common, "--node-rank", "0", *script, **ENV),
        start_on(two_hosts, 1, *node1, **ENV),
    ]
    try:
        _, lost_err = procs[1].communicate(timeout=scaled(120))  # the node vanishes at step 10
        assert procs[1].returncode == -9, lost_err
        relaunched = time.monotonic()
        procs.append(start_on(two_hosts, 1, *node1, **ENV))  # the same command again
        out0, err0 = procs[0].communicate(timeout=scaled(240))
        out1, err1 = procs[2].communicate(timeout=scaled(60))
    finally:
        for p in procs:
            stop(p)
    print(
        f"two-node run {time.monotonic() - start:.1f} s, relaunch to end "
        f"{time.monotonic() - relaunched:.1f} s"
    )
    print("\n".join(line for line in (err0 + err1).splitlines() if "node 1" in line))
    assert procs[0].returncode == 0, out0 + err0
    assert procs[2].returncode == 0, out1 + err1
    for rank, local in ((2, 0), (3, 1)):
        assert f"rank {rank} (member 1.{local}, incarnation 0) is lost" in err0, err0
        assert f"rank {rank} (member 1.{local}, incarnation 1) started as pid" in err1, err1
    assert "node 1 is back" in err0, err0
    assert "job finished: 4 of 4 workers ran to the end (exit 0)" in err0, err0
    assert "replacements used: 2 of 2 (--max-restarts)" in err0, err0
    run = check_records(folder, err0 + err1)
    assert set(run) == {"0.0.0", "0.1.0", "1.0.1", "1.1.1"}  # survivors kept, 2 replacements
    regroups = run["0.0.0"]["regroups"]
    assert regroups[0][:2] == ["lost", 2] and regroups[-1][:2] == ["joined", 4], regroups
    reference = live_job(tmp_path / "fault-free", "-", "live-exact", 0)["0.0.0"]
    assert run["0.0.0"]["digest"] == reference["digest"]


def test_a_node_lost_near_the_end_is_a_loss_not_a_death_after_the_finish(
    two_hosts: Hosts, tmp_path: Path
) -> None:
    # Node 1 vanishes at step 58 of 60 and is not run again. The survivors miss its workers'
    # heartbeats (15 s), go on at world 2 and finish; node 0's agent declares the node lost
    # later (30 s of silence, the default). Its workers died when it went silent, before the
    # finish: the job finished at a smaller world with 2 workers lost for good (a non-zero
    # exit, as a loss is never a success). Before, node 0 dated their deaths at the declaration
    # and failed the job for "exit code 1 of a worker after another had finished".
    folder = tmp_path / "nodes"
    folder.mkdir()
    common = [
        *("--nnodes", "2", "--nproc-per-node", "2", "--master-addr", two_hosts.addr[0]),
        *("--master-port", "29567", "--rdzv-timeout", "30", "--recovery", "live"),
    ]
    script = [LIVE_SCRIPT, str(folder), "2@58@node", "0.05", "live-exact"]
    env = {"PHALANX_JOB_SECRET": ENV["PHALANX_JOB_SECRET"]}
    procs = [
        start_on(two_hosts, 0, *common, "--node-rank", "0", *script, **env),
        start_on(two_hosts, 1, *common, "--node-rank", "1", *script, **env),
    ]
    try:
        _, lost_err = procs[1].communicate(timeout=scaled(120))
        assert procs[1].returncode == -9, lost_err
        lost_at = time.monotonic()
        out0, err0 = procs[0].communicate(timeout=scaled(120))
        ended_after = time.monotonic() - lost_at
    finally:
        for p in procs:
            stop(p)
    assert procs[0].returncode == 1, out0 + err0
    assert "after another had finished" not in err0, err0
    assert (
        "job failed: it finished at a smaller world, 2 of 4 workers ran to the end and 2 were "
        "lost for good" in err0
    ), err0
    assert ended_after < scaled(60), ended_after  # 2x the 30 s silence at most
    survivors = {p.stem: json.loads(p.read_text()) for p in folder.glob("0.*.json")}
    assert set(survivors) == {"0.0.0", "0.1.0"}, survivors
    for record in survivors.values():
        assert record["step"] == 60 and record["world_size"] == 2, record
