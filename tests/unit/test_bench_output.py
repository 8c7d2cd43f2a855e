"""Where benchmark numbers go: a new directory per run, rows kept as measured, RESULT last."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from phalanx.bench.common import Output, add_output_flags, default_out


def test_the_default_is_a_new_directory_under_runs(tmp_path: Path) -> None:
    first = default_out("comm", tmp_path / "runs", now=0)
    assert first.parent == tmp_path / "runs" and first.name.startswith("bench-comm-")
    assert first.is_dir()
    second = default_out("comm", tmp_path / "runs", now=0)  # same second: never the same place
    assert second.name == f"{first.name}-2" and second.is_dir()


def test_out_defaults_to_none_and_json_stays_an_extra_copy() -> None:
    parser = argparse.ArgumentParser()
    add_output_flags(parser, "ddp")
    assert vars(parser.parse_args([])) == {"out": None, "json": None}
    assert vars(parser.parse_args(["--out", "D", "--json", "F"])) == {"out": "D", "json": "F"}


def test_rows_are_printed_and_kept_as_measured_and_result_comes_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    out = Output.create("demo", None, json_path=str(tmp_path / "copy.json"))
    assert out.directory.parent == Path("runs") and out.directory.is_dir()
    out.rows([{"impl": "ring", "p50_ms": 1.23456, "times": [1, 2]}])
    kept = (out.directory / "rows.jsonl").read_text()
    assert json.loads(kept) == {"impl": "ring", "p50_ms": 1.23456, "times": [1, 2]}
    out.rows([{"impl": "tree", "p50_ms": 2.0}])
    out.result({"rows": 2}, line={"ok": True})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"phalanx bench demo: results go to {out.directory}/"
    assert printed[1:] == [
        "  measured: impl=ring, p50_ms=1.235",  # lists stay in rows.jsonl only
        "  measured: impl=tree, p50_ms=2",
        'RESULT {"ok": true}',
    ]
    assert len((out.directory / "rows.jsonl").read_text().splitlines()) == 2
    assert json.loads((out.directory / "demo.json").read_text()) == {"rows": 2}
    assert json.loads((tmp_path / "copy.json").read_text()) == {"rows": 2}
