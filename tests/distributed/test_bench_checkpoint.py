"""``phalanx bench checkpoint`` runs every implementation on 2 ranks and ends with a RESULT line.

Its warm-up round loads every checkpoint, the asynchronous ones' included, into zeroed tensors
and fails unless the saved state comes back exactly, so this run also checks that each
implementation round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.bench.checkpoint import main

SYNC = {"phalanx", "dcp", "raw"}
ASYNC = ("phalanx_async", "dcp_async", "dcp_async_process")


def test_bench_checkpoint_on_two_ranks_prints_a_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    argv = ["--mb", "1", "--ranks", "2", "--rounds", "2", "--cold"]
    assert main([*argv, "--dir", str(work), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    last = printed.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    assert set(result["impls"]) == SYNC and result["ranks"] == 2
    for impl in SYNC:
        row = result["impls"][impl]
        assert row["save_mbps"] > 0 and row["load_mbps"] > 0 and row["load_cold_mbps"] > 0
    for key in ("save_ratio_vs_dcp", "load_ratio_vs_dcp", "load_cold_ratio_vs_raw"):
        assert result[key] > 0, key
    for impl in ASYNC:
        assert 0 < result[impl]["block_s"] <= result[impl]["total_s"], impl
        assert result[impl]["step_slowdown"] > -1, impl  # a ratio of step times, less one
    assert len(result["cases"]) == 1 and result["cases"][0]["impls"] == result["impls"]
    assert list(work.iterdir()) == []  # every case's directory is removed
    assert json.loads((out / "checkpoint.json").read_text()) == result
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["round"], r["impl"]) for r in rows) == sorted(
        (rnd, impl) for rnd in (1, 2) for impl in [*SYNC, *ASYNC]
    )


@pytest.mark.parametrize(("flag", "value"), [("--mb", "0"), ("--ranks", "two"), ("--rounds", "0")])
def test_bad_arguments_are_named(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([flag, value])
    err = capsys.readouterr().err
    assert f"{flag} must be" in err and (f"got {value!r}" in err or f"got {value}" in err)
