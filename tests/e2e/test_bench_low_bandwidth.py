"""``phalanx bench low_bandwidth``: a method trained across two namespaces over a capped link.

A short run of one method (DiLoCo, int8 outer gradients) end to end: the link, one
``phalanx run`` agent per namespace, the worker's report and the ``RESULT`` line. Its rows
and its refusal of bad arguments are checked without a link.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import phalanx
from phalanx.bench.hosts import unavailable
from phalanx.bench.low_bandwidth import main, summarize
from phalanx.bench.low_bandwidth_worker import METHODS, strategy_for


@pytest.mark.netns
@pytest.mark.extended
def test_one_method_over_the_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    argv = ["--methods", "diloco_int8", "--steps", "6", "--sync-every", "3", "--mbit", "50"]
    assert main([*argv, "--no-plot", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last.removeprefix("RESULT "))
    row = result["methods"]["diloco_int8"]
    assert result["link_mbit"] == 50 and 0 < row["utilisation"] <= 1
    # two outer steps of a ~0.4 M-parameter GPT in int8 (plus scales), and the protocols'
    # own bytes: between 0.5 and 10 MB each way
    assert 0.5e6 < row["bytes_per_rank"] < 10e6, row
    assert row["collective_bytes"] > 0 and 1 < row["final_val_loss"] < 5
    assert row["curve"] == []  # evaluated every 50 steps: none in 6


def _report(rank: int, local_rank: int, tx: int, wall: float, loss: float | None) -> dict:
    worker = {"final_val_loss": loss, "utilisation": loss and loss / 4, "curve": [rank]}
    server = {"server": loss is None, "rank": rank, "local_rank": local_rank}
    return {**server, "tx_bytes": tx, "wall_s": wall, "collective_bytes": None, **worker}


def test_rows_average_the_workers_and_count_each_machine_once() -> None:
    reports = [_report(0, 0, 100, 1.0, None), _report(1, 1, 100, 3.0, 2.0)]
    row = summarize([*reports, _report(2, 0, 300, 2.0, 3.0)], 10.0)
    assert row["bytes_per_rank"] == 200 and row["wall_s"] == 3.0
    assert row["final_val_loss"] == 2.5 and row["utilisation"] == pytest.approx(0.625)
    assert row["curve"] == [1]  # the first worker's


def test_every_method_has_a_strategy() -> None:
    kinds = {m: type(strategy_for(m, 10)).__name__ for m in METHODS}
    assert kinds["diloco_int8"] == "DiLoCo" and strategy_for("diloco_int8", 10).quantise == "int8"
    assert kinds["streaming_diloco"] == "StreamingDiLoCo" and kinds["ps_async"] == "PS"
    assert isinstance(strategy_for("powersgd", 10), phalanx.DDP)
    with pytest.raises(ValueError, match="got 'adam'"):
        strategy_for("adam", 10)


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--methods", "ddp,nope"], "--methods"), (["--mbit", "0"], "--mbit must be > 0")],
)
def test_bad_arguments_are_named(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert named in capsys.readouterr().err
