"""torchrun (not ``phalanx run``) on two namespace hosts whose names do not resolve, as on many
clusters (issue 35, point 6).

torchrun sets no ``GLOO_SOCKET_IFNAME``, and gloo, unable to resolve ``mh0`` / ``mh1``, falls
back to loopback: each rank tells the other to connect to 127.0.0.1, and the job fails at its
timeout. ``phalanx.init_process_group`` pins the interface that routes to the master, as
``phalanx run`` does for its workers, so the same script joins across the hosts.
"""

from __future__ import annotations

import sys

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS, free_port
from tests.multihost.hosts import host_env, stop

pytestmark = pytest.mark.netns

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SCRIPT = str(SCRIPTS / "phalanx_allreduce.py")


def test_torchrun_across_hosts_that_do_not_resolve_pins_gloos_interface(
    two_hosts: Hosts,
) -> None:
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", two_hosts.addr[0]]
    flags += ["--master-port", str(free_port())]
    timeout = str(round(scaled(30)))
    procs = [
        two_hosts.popen(
            host, [*TORCHRUN, *flags, "--node-rank", str(host), SCRIPT, timeout], env=host_env()
        )
        for host in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=scaled(120)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    assert "RANK 0 SUM 3 IFNAME eth0" in outs[0][0], outs[0]
    assert "RANK 1 SUM 3 IFNAME eth0" in outs[1][0], outs[1]
