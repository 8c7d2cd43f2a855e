"""``phalanx bench ddp --shm``: a phalanx-DDP-on-shm row, interleaved with the other two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench.ddp import summarize


def test_summarize_takes_every_implementation_measured() -> None:
    steps = {
        "mlp/25": {
            "torch": [0.1, 0.1],
            "torch_compute": [0.06, 0.06],
            "phalanx-shm": [0.08, 0.08],
            "phalanx-shm_compute": [0.06, 0.06],
        }
    }
    torch_row, shm_row = summarize(steps)
    assert (torch_row["impl"], shm_row["impl"]) == ("torch", "phalanx-shm")
    assert shm_row["ratio_vs_torch"] == pytest.approx(0.8)
    assert shm_row["exposed_comm_ms"] == pytest.approx(20.0)


def test_shm_row_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.bench.ddp",
            "--quick",
            "--shm",
            "--no-hooks",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["impl"] for r in result["rows"]] == ["torch", "phalanx", "phalanx-shm"]
    assert all(r["p50_ms"] > 0 for r in result["rows"])
