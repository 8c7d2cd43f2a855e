"""``phalanx bench comm --shm``: gloo, shm copy-in, shm with shared buffers and memcpy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench.comm import format_table, parse_args, summarize


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


def test_shm_run_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.bench.comm",
            "--shm",
            "--ops",
            "all_reduce,all_gather",
            "--min-bytes",
            "4KiB",
            "--max-bytes",
            "64KiB",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
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
