"""`phalanx plan`: the ZeRO paper's worked example and the formulas behind it."""

from __future__ import annotations

import json

import pytest

from phalanx import cli
from phalanx.plan import bytes_per_param, estimate


def test_paper_worked_example_7_5b_params_on_64_gpus() -> None:
    totals = {
        r.strategy: round(r.total / 1e9, 1) for r in estimate(7.5e9, 64, "adam", "fp16-master")
    }
    assert totals == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def test_communication_volume_ddp_zero12_2psi_zero3_3psi() -> None:
    rows = {r.strategy: r for r in estimate(1e6, 8)}
    assert [rows[s].comm_elements for s in ("ddp", "zero1", "zero2", "zero3")] == [
        2e6,
        2e6,
        2e6,
        3e6,
    ]
    assert rows["ddp"].comm_bytes == 2e6 * 2  # fp16 gradients


@pytest.mark.parametrize(
    ("optimizer", "precision", "expected"),
    [
        ("adam", "fp16-master", (2, 2, 12)),
        ("adam", "fp32", (4, 4, 8)),
        ("sgd", "fp32", (4, 4, 0)),
        ("sgd-momentum", "fp16-master", (2, 2, 8)),
    ],
)
def test_bytes_per_param(optimizer: str, precision: str, expected: tuple[int, int, int]) -> None:
    assert bytes_per_param(optimizer, precision) == expected


def test_fp32_adam_optimizer_state_is_8_psi_over_n() -> None:
    zero1 = next(r for r in estimate(1000, 4, "adam", "fp32") if r.strategy == "zero1")
    assert zero1.optimizer == 8 * 1000 / 4


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        estimate(1e6, 2, "lamb")
    with pytest.raises(ValueError, match="dp must be >= 1, got 0"):
        estimate(1e6, 0)


def test_cli_prints_the_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert figure in out
    assert cli.main(["plan", "--params", "1e6", "--dp", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == ["ddp", "zero1", "zero2", "zero3"]
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--params", "-5"])
    assert exc.value.code == 2
