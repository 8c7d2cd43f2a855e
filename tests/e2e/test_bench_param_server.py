"""`phalanx bench param_server --quick` runs every mode and writes its JSON, PNG and RESULT into a
new directory under runs/, leaving the committed results in benchmarks/results/ as they were."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from phalanx.bench.param_server import main

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _digests() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in COMMITTED.iterdir()}


@pytest.mark.extended
def test_quick_param_server_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digests()
    monkeypatch.chdir(tmp_path)
    assert main(["--quick"]) == 0  # no --out
    assert _digests() == before, "a quick run changed the committed results"
    (out,) = (tmp_path / "runs").glob("bench-param_server-*")
    printed = capsys.readouterr().out.splitlines()
    result = json.loads(printed[-1].removeprefix("RESULT "))
    verdict = result["4x"]
    for key in ("async_speedup", "ssp2_speedup", "ssp4_speedup"):
        assert verdict[key] > 0
    assert isinstance(verdict["async_ge_1_5x"], bool)
    runs = json.loads((out / "param_server.json").read_text())["runs"]["4x"]
    assert set(runs) == {"ddp", "ps-sync", "ps-async", "ssp2", "ssp4"}
    for mode, run in runs.items():
        assert run["applied"] == 60 and run["updates_per_s"] > 0, mode
        assert 0.0 <= run["final_acc"] <= 1.0 and run["curve"], mode
    assert runs["ps-sync"]["staleness"] == {"0": 60}  # JSON keys; sync is never stale
    assert max(int(k) for k in runs["ssp2"]["staleness"]) <= 2
    assert (out / "param_server.png").stat().st_size > 10_000
    # each run's row was printed and kept as it finished, before the tables
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["ddp", "ps-sync", "ps-async", "ssp2", "ssp4"]
    measured = [i for i, line in enumerate(printed) if line.startswith("  measured: straggler=")]
    assert len(measured) == 5 and measured[-1] < printed.index("straggler 4x:")
