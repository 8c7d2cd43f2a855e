"""``--shm`` of ``phalanx bench comm`` (gloo, shm copy-in, shm-buffers, memcpy) and of
``phalanx bench ddp`` (a phalanx-DDP-on-shm row), interleaved with the usual rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench import ddp
from phalanx.bench.comm import format_table, parse_args, summarize


def _run(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--shm", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_shm_flag_and_ratios_to_gloo_and_memcpy() -> None:
    assert parse_args(["--shm"]).shm and not parse_args([]).shm
    records = [
        {"op": "all_reduce", "bytes": 4_000_000, "impl": "native", "times": [0.004]},
        {"op": "all_reduce", "bytes": 4_000_000, "impl": "shm-buffers", "times": [0.001]},
        {"op": "all_reduce", "bytes": 4_000_000, "impl": "memcpy", "times": [0.0005]},
    ]
    gloo, zero_copy, memcpy = summarize(records, world=2)
    assert memcpy.busbw_gbps == pytest.approx(8.0)  # a copy's busbw is its algbw
    assert zero_copy.busbw_gbps == pytest.approx(4.0) and zero_copy.vs_native == 4.0
    assert zero_copy.vs_memcpy == pytest.approx(0.5) and gloo.vs_memcpy == pytest.approx(0.125)
    assert "vs memcpy" in format_table([gloo, zero_copy, memcpy]).splitlines()[0]
    assert math.isnan(summarize(records[:1], world=2)[0].vs_memcpy)


def test_comm_shm_run_end_to_end(tmp_path: Path) -> None:
    args = ("--ops", "all_reduce,all_gather", "--min-bytes", "4KiB", "--max-bytes", "64KiB")
    proc = _run(tmp_path, "phalanx.bench.comm", *args, "--iters", "2", "--warmup", "1")
    result = json.loads(proc.stdout.strip().splitlines()[-1][len("RESULT ") :])
    rows = result["rows"]
    impls = {(r["op"], r["impl"]) for r in rows}
    assert impls == {
        (op, impl)
        for op in ("all_reduce", "all_gather")
        for impl in ("native", "shm", "shm-buffers", "memcpy")
    }
    assert all(r["busbw_gbps"] > 0 and r["vs_memcpy"] > 0 for r in rows)
    assert all(r["vs_memcpy"] == 1.0 for r in rows if r["impl"] == "memcpy")
    assert "gloo vs shm" in proc.stdout


def test_summarize_takes_every_implementation_measured() -> None:
    steps = {
        "mlp/25": {
            "torch": [0.1, 0.1],
            "torch_compute": [0.06, 0.06],
            "phalanx-shm": [0.08, 0.08],
            "phalanx-shm_compute": [0.06, 0.06],
        }
    }
    torch_row, shm_row = ddp.summarize(steps)
    assert (torch_row["impl"], shm_row["impl"]) == ("torch", "phalanx-shm")
    assert shm_row["ratio_vs_torch"] == pytest.approx(0.8)
    assert shm_row["exposed_comm_ms"] == pytest.approx(20.0)


@pytest.mark.extended
def test_ddp_shm_row_end_to_end(tmp_path: Path) -> None:
    _run(tmp_path, "phalanx.bench.ddp", "--quick", "--no-hooks", "--iters", "2", "--warmup", "1")
    result = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["impl"] for r in result["rows"]] == ["torch", "phalanx", "phalanx-shm"]
    assert all(r["p50_ms"] > 0 for r in result["rows"])
