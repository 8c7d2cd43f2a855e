"""The checkpoint benchmark runs end to end on a tiny state and ends with a RESULT line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.bench.checkpoint import main


def test_bench_checkpoint_prints_a_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    assert main(["--mb", "2", "--rounds", "1", "--dir", str(work), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    last = printed.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    assert set(result["impls"]) == {"phalanx", "dcp", "raw"}
    assert result["save_ratio_vs_dcp"] > 0 and result["load_ratio_vs_raw"] > 0
    assert list(work.iterdir()) == []  # the work directory is removed
    assert json.loads((out / "checkpoint.json").read_text()) == result
    rounds = (out / "rows.jsonl").read_text().splitlines()
    assert len(rounds) == 3 and printed.count("measured: round=1") == 3  # one per impl
