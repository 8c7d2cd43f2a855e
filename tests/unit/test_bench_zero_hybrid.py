"""``phalanx bench zero_hybrid``'s summary of the ranks' reports (the run itself needs root)."""

from __future__ import annotations

import pytest

from phalanx.bench.zero_hybrid import main, summarize


def _report(rank: int, local: int, tx: float) -> dict[str, object]:
    impls = {
        "hybrid3": {
            "times": [0.5, 0.7, 0.6],
            "comm_bytes": 8,
            "host_tx_bytes": tx,
            "state": {"p": 4},
        },
        "zero3": {
            "times": [1.0, 1.2, 1.4],
            "comm_bytes": 5,
            "host_tx_bytes": 3 * tx,
            "state": {"p": 2},
        },
        "torch-hsdp": {
            "times": [0.8, 0.8],
            "comm_bytes": None,
            "host_tx_bytes": tx,
            "state": {"p": 4},
        },
    }
    return {"rank": rank, "local_rank": local, "impls": impls}


def test_rows_average_the_hosts_link_bytes_and_take_ratios() -> None:
    reports = [_report(0, 0, 100.0), _report(1, 1, 0.0), _report(2, 0, 300.0), _report(3, 1, 0.0)]
    rows = {r["impl"]: r for r in summarize(reports)}
    assert rows["hybrid3"]["host_tx_bytes_per_step"] == 200.0  # hosts' first ranks only
    assert rows["zero3"]["host_tx_bytes_per_step"] == 600.0
    assert rows["hybrid3"]["p50_ms"] == pytest.approx(600.0)
    assert rows["hybrid3"]["vs_torch-hsdp"] == pytest.approx(0.75)
    assert rows["hybrid3"]["vs_zero3"] == pytest.approx(0.5)
    assert rows["torch-hsdp"]["comm_bytes_per_step"] is None
    assert rows["zero3"]["model_state_bytes"] == 2


def test_unknown_implementations_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--impls", "hybrid3,fsdp9"])
    assert "--impls must name some of hybrid3, zero3" in capsys.readouterr().err
