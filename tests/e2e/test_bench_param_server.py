"""`phalanx bench param_server --quick` runs every mode and writes its JSON, PNG and RESULT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.bench.param_server import main


def test_quick_param_server_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix("RESULT "))
    verdict = result["4x"]
    for key in ("async_speedup", "ssp2_speedup", "ssp4_speedup"):
        assert verdict[key] > 0
    assert isinstance(verdict["async_ge_1_5x"], bool)
    runs = json.loads((tmp_path / "param_server.json").read_text())["runs"]["4x"]
    assert set(runs) == {"ddp", "ps-sync", "ps-async", "ssp2", "ssp4"}
    for mode, run in runs.items():
        assert run["applied"] == 60 and run["updates_per_s"] > 0, mode
        assert 0.0 <= run["final_acc"] <= 1.0 and run["curve"], mode
    assert runs["ps-sync"]["staleness"] == {"0": 60}  # JSON keys; sync is never stale
    assert max(int(k) for k in runs["ssp2"]["staleness"]) <= 2
    assert (tmp_path / "param_server.png").stat().st_size > 10_000
