"""Two namespace hosts (``bench.hosts``), each running its own ``phalanx run`` agent.

Node 0 and node 1 have 2 workers each; the four workers all_reduce across the bridge.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS
from tests.multihost.hosts import host_env, start_on, stop

pytestmark = pytest.mark.netns

SCRIPT = str(SCRIPTS / "env_allreduce.py")


FORMS = {
    "static": ["--master-addr", "{addr}", "--master-port", "29561", "--node-rank", "{node}"],
    "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "{addr}:29561", "--node-rank", "{node}"],
}


@pytest.mark.parametrize("form", FORMS)
def test_two_nodes_all_reduce_across_hosts(two_hosts: Hosts, form: str) -> None:
    def node(rank: int) -> list[str]:
        flags = [f.format(addr=two_hosts.addr[0], node=rank) for f in FORMS[form]]
        return ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-timeout", "30", *flags, SCRIPT]

    procs = []
    try:
        # Node 1 first: it must wait (connection refused) until node 0 is up.
        procs.append(start_on(two_hosts, 1, *node(1)))
        procs.append(start_on(two_hosts, 0, *node(0)))
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
    assert f"worker store {two_hosts.addr[0]}:" in outs[1][1]


def test_torchruns_c10d_form_without_node_ranks(three_hosts: Hosts) -> None:
    # Every host runs the same command, as with torchrun: the host that owns the endpoint's
    # address (mh1 here, not the first host) hosts the store and is node 0; the others take
    # node ranks 1 and 2 at the rendezvous. (Before, each defaulted to node 0 and the others
    # failed: "node 0 cannot host the rendezvous store ... not an address of this machine".)
    endpoint = f"{three_hosts.addr[1]}:29562"
    flags = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    command = [*flags, "--rdzv-endpoint", endpoint, "--rdzv-timeout", "30", SCRIPT]
    procs = []
    try:
        procs = [start_on(three_hosts, h, *command) for h in (2, 0, 1)]
        outs = [p.communicate(timeout=scaled(90)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    by_host = dict(zip((2, 0, 1), outs))
    assert '"GROUP_RANK": "0"' in by_host[1][0] and "[rank 0] SUM 6" in by_host[1][0]
    assert "node 0 of 3: rendezvous store listening on" in by_host[1][1]
    ranks = set()
    for h in (0, 2):
        out, err = by_host[h]
        (rank,) = [r for r in (1, 2) if f'"GROUP_RANK": "{r}"' in out]
        assert f"[rank {rank}] SUM 6" in out, out
        assert f"node rank {rank} of 3 taken at the rendezvous store {endpoint}" in err, err
        ranks.add(rank)
    assert ranks == {1, 2}


# Times phalanx.launch.main itself, so that interpreter and torch start-up do not count.
TIMED_MAIN = """
import sys, time
from phalanx.launch import main
start = time.monotonic()
code = main(sys.argv[1:])
print(f"ELAPSED {time.monotonic() - start:.3f}")
sys.exit(code)
"""


def test_unreachable_network_fails_fast(two_hosts: Hosts) -> None:
    # Namespace a has no route to 10.99.0.0/16: connect() fails with ENETUNREACH at once.
    proc = subprocess.run(
        two_hosts.command(
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
        env=host_env(),
    )
    assert proc.returncode == 1
    assert "cannot reach the master 10.99.0.1:29561: network is unreachable" in proc.stderr
    assert float(proc.stdout.split("ELAPSED ")[1]) < 5.0


def test_a_host_with_another_secret_is_refused_by_name(two_hosts: Hosts) -> None:
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", two_hosts.addr[0]]
    common += ["--master-port", "29569", "--rdzv-timeout", "30", SCRIPT]
    node0 = start_on(two_hosts, 0, "--node-rank", "0", *common, PHALANX_JOB_SECRET="ab" * 32)
    try:
        node1 = start_on(two_hosts, 1, "--node-rank", "1", *common, PHALANX_JOB_SECRET="cd" * 32)
        out, err = node1.communicate(timeout=scaled(60))
    finally:
        stop(node0)
    assert node1.returncode == 1, out + err
    assert "node 1 on mh1 cannot join job" in err, err
    assert f"at the rendezvous store {two_hosts.addr[0]}:29569" in err, err
    assert "set the same PHALANX_JOB_SECRET on every node" in err, err
    assert "[rank" not in out  # no worker started
