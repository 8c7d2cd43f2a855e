"""Two "machines" on one host: two network namespaces joined by a veth pair (``slow_link``).

Each namespace runs its own ``phalanx run`` agent (node 0 and node 1, 2 workers each); the four
workers all_reduce across the pair. The namespaces, and the veth with them, are always deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.bench.slow_link import Link
from phalanx.testing import scaled
from tests.e2e.namespaces import netns_env, start_in, stop

pytestmark = pytest.mark.netns

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "env_allreduce.py")


def test_two_nodes_all_reduce_across_namespaces(pair: Link) -> None:
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        pair.addr[0],
        "--master-port",
        "29561",
        "--rdzv-timeout",
        "30",
    ]
    procs = []
    try:
        # Node 1 first: it must wait (connection refused) until node 0 is up.
        procs.append(start_in(pair, 1, *common, "--node-rank", "1", SCRIPT))
        time.sleep(0.3)
        procs.append(start_in(pair, 0, *common, "--node-rank", "0", SCRIPT))
        outs = [p.communicate(timeout=scaled(90)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    node1_out, node0_out = outs[0][0], outs[1][0]
    for rank in (0, 1):
        assert f"[rank {rank}] SUM 10" in node0_out
    for rank in (2, 3):
        assert f"[rank {rank}] SUM 10" in node1_out
    assert '"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"' in node1_out
    assert f"worker store {pair.addr[0]}:" in outs[1][1]


# Times phalanx.launch.main itself, so that interpreter and torch start-up do not count.
TIMED_MAIN = """
import sys, time
from phalanx.launch import main
start = time.monotonic()
code = main(sys.argv[1:])
print(f"ELAPSED {time.monotonic() - start:.3f}")
sys.exit(code)
"""


def test_unreachable_network_fails_fast(pair: Link) -> None:
    # Namespace a has no route to 10.99.0.0/16: connect() fails with ENETUNREACH at once.
    proc = subprocess.run(
        pair.command(
            0,
            [
                sys.executable,
                "-c",
                TIMED_MAIN,
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "10.99.0.1",
                "--master-port",
                "29561",
                SCRIPT,
            ],
        ),
        capture_output=True,
        text=True,
        timeout=60,
        env=netns_env(),
    )
    assert proc.returncode == 1
    assert "cannot reach the master 10.99.0.1:29561: network is unreachable" in proc.stderr
    assert float(proc.stdout.split("ELAPSED ")[1]) < 5.0


ELASTIC = str(Path(__file__).resolve().parent / "scripts" / "elastic_job.py")


def test_node_loss_continues_on_the_remaining_node(pair: Link, tmp_path: Path) -> None:
    # --nnodes 1:2: when node 1 disappears (its launcher and workers SIGKILLed), node 0's
    # workers fail, node 0 restarts, closes the next rendezvous with itself alone after the
    # last call, and resumes from the newest checkpoint at world size 2 with ranks 0..1.
    ckpt = tmp_path / "ckpt"
    common = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        pair.addr[0],
        "--master-port",
        "29563",
        "--rdzv-timeout",
        "30",
        "--max-restarts",
        "1",
    ]
    procs = [
        start_in(pair, 0, *common, "--node-rank", "0", ELASTIC, str(ckpt)),
        start_in(pair, 1, *common, "--node-rank", "1", ELASTIC, str(ckpt)),
    ]
    try:
        deadline = time.monotonic() + 60
        while not list(ckpt.glob("step-*")):  # training (at world size 4) has saved once
            assert procs[0].poll() is None, procs[0].communicate()
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the machine disappears
        out, err = procs[0].communicate(timeout=scaled(120))
    finally:
        for p in procs:
            stop(p)
    assert procs[0].returncode == 0, out + err
    assert "[rank 0] GEN 0 WORLD 4" in out and "[rank 0] GEN 1 WORLD 2" in out
    assert "generation 1 starts with nodes [0]" in err
    assert "resumed from" in out + err
    assert "[rank 0] DONE WORLD 2 STEPS" in out
