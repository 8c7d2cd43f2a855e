"""A cut network link between two namespace hosts (issue 35, point 7): the hang report names
the link to the silent host as a possible cause, beside a dead or stuck process; once the link
is mended, the collective completes and the job ends well."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS, free_port
from tests.multihost.hosts import LAUNCH, host_env, stop

pytestmark = pytest.mark.netns

SCRIPT = str(SCRIPTS / "cut_link_job.py")


def _wait_for(path: Path, text: str, deadline_s: float) -> str:
    """The file's text once it holds ``text``; fail past the (scaled) deadline."""
    deadline = time.monotonic() + scaled(deadline_s)
    while time.monotonic() < deadline:
        found = path.read_text() if path.exists() else ""
        if text in found:
            return found
        time.sleep(0.1)
    pytest.fail(f"{text!r} not in {path} within {scaled(deadline_s):.0f} s:\n{found}")


def test_the_hang_report_names_the_cut_link_to_the_silent_host(
    two_hosts: Hosts, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", two_hosts.addr[0]]
    flags += ["--master-port", str(free_port()), "--rdzv-timeout", "60"]
    procs, outs = [], []
    try:
        for host in (0, 1):
            out, err = tmp_path / f"out{host}", tmp_path / f"err{host}"
            outs.append((out, err))
            argv = [*LAUNCH, *flags, "--node-rank", str(host), SCRIPT, str(go)]
            with out.open("w") as o, err.open("w") as e:
                env = host_env(PHALANX_HANG_TIMEOUT="2")
                procs.append(two_hosts.popen(host, argv, env=env, stdout=o, stderr=e))
        _wait_for(outs[0][0], "[rank 0] READY", 120)
        two_hosts.cut(1)
        go.touch()
        report = _wait_for(outs[0][1], "phalanx hang report", 60)
        report = _wait_for(outs[0][1], "still run.", 10)
        two_hosts.mend(1)
        codes = [p.wait(timeout=scaled(60)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    assert codes == [0, 0], [err.read_text() for _, err in outs]
    assert "[rank 0] DONE 4" in outs[0][0].read_text()
    assert "[rank 1] DONE 4" in outs[1][0].read_text()
    host, addr = two_hosts.names[1], two_hosts.addr[1]
    assert f"rank 1 (host {host}, {addr}, pid" in report, report
    assert (
        f"No rank on host {host} ({addr}) answered (rank(s) [1], on another machine than the "
        f"reporting rank): the network link to {host} may be down or partitioned, besides those "
        f"ranks being dead or stuck; check that this machine reaches {addr} and that they "
        "still run."
    ) in report, report
