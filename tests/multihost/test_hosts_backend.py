"""The default backend across machines (issue 35, "choose the backend by measurement"): on
namespace hosts that each run 2 CPU ranks, "auto" is the hierarchical shm group (shared memory
inside each host, gloo between them) and the start-up line says so; a host with a single rank
keeps every rank on gloo. ``phalanx bench hosts_backend``, which measured it, runs and ends with
its RESULT line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.bench import hosts_backend
from phalanx.bench.hosts import Hosts
from phalanx.testing import scaled
from tests.e2e.launching import SCRIPTS
from tests.multihost.hosts import make_hosts, start_on, stop

pytestmark = pytest.mark.netns

SCRIPT = str(SCRIPTS / "show_backend.py")


@pytest.fixture
def four_hosts(tmp_path: Path) -> Iterator[Hosts]:
    """Four namespace hosts (two jobs side by side) sharing ``tmp_path``."""
    yield from make_hosts(4, tmp_path)


def test_auto_is_hierarchical_shm_when_every_host_runs_two(four_hosts: Hosts) -> None:
    # Job A: 2 + 2 ranks on hosts 0 and 1. Job B: 2 + 1 ranks on hosts 2 and 3. Before, both
    # got gloo ("default backend gloo (CPU ranks on several machines)").
    jobs = {"a": (0, (2, 2), 29571), "b": (2, (2, 1), 29572)}
    procs = []
    try:
        for first, nprocs, port in jobs.values():
            master = ["--master-addr", four_hosts.addr[first], "--master-port", str(port)]
            for node, nproc in enumerate(nprocs):
                place = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc)]
                procs.append(
                    start_on(
                        four_hosts, first + node, *place, *master, "--rdzv-timeout", "60", SCRIPT
                    )
                )
        outs = [p.communicate(timeout=scaled(120)) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    a_out = outs[0][0] + outs[1][0]
    for rank in range(4):
        assert f"[rank {rank}] BACKEND shm SUM 4" in a_out, a_out
    assert (
        "default backend shm (hierarchical: shared memory inside each machine, gloo between "
        "them; measured faster than gloo across machines; --backend gloo opts out)"
    ) in outs[0][1]
    b_out = outs[2][0] + outs[3][0]
    for rank in range(3):
        assert f"[rank {rank}] BACKEND gloo SUM 3" in b_out, b_out
    single = "default backend gloo (CPU ranks on several machines, one of them with a single rank)"
    assert single in outs[2][1] and single in outs[3][1]


@pytest.mark.extended
def test_the_benchmark_runs_and_ends_with_its_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mbit", "1000", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    argv += ["--hidden", "64", "--batch", "8", "--out", str(tmp_path / "out")]
    assert hosts_backend.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    assert set(result) == {"config", "rates", "ratios", "startup_line"}
    row = result["rates"]["1000"]
    assert row["default_group"] == "HierarchicalProcessGroup" and row["world_size"] == 4
    assert result["ratios"]["1000"] == row["ratio"] > 0
    for name in ("shm", "gloo"):
        assert row["backends"][name]["p50_ms"] > 0
        assert len(row["backends"][name]["final_loss"]) == 1
    # each machine sends its sum once instead of each rank its share of gloo's ring: ~2/3
    assert 0.5 < row["bytes_ratio"] < 0.85
    assert row["same_loss"] and row["max_param_diff"] < 1e-5
    assert "backend shm (shared memory inside each machine" in result["startup_line"]
