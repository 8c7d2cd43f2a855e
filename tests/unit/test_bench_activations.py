"""``phalanx bench activations``: its rows from measured times and peaks, and its flags."""

from __future__ import annotations

import pytest

from phalanx.bench import activations


def _measured(times: list[float], peaks: list[float], losses: list[float]) -> dict[str, object]:
    return {"times": times, "peaks": peaks, "losses": losses}


def test_rows_compare_each_form_with_none_and_full_with_torchs() -> None:
    result = {
        "zero3/none": _measured([1.0, 1.2, 1.1], [100.0, 100.0], [3.0, 2.0]),
        "zero3/full": _measured([1.3, 1.32, 1.5], [40.0, 42.0], [3.0, 2.0]),
        "zero3/torch-full": _measured([1.2, 1.2, 1.25], [41.0, 41.0], [3.0, 2.0]),
        "zero3/selective": _measured([1.0, 1.1, 1.2], [80.0, 80.0], [3.0, 2.5]),
    }
    rows = {r["variant"]: r for r in activations.summarize(result)}
    assert rows["none"]["time_vs_none"] == 1.0 and rows["none"]["peak_vs_none"] == 1.0
    assert rows["full"]["time_vs_none"] == pytest.approx(1.32 / 1.1)
    assert rows["full"]["time_vs_torch"] == pytest.approx(1.32 / 1.2)
    assert rows["full"]["peak_vs_none"] == pytest.approx(0.41)
    assert rows["selective"]["time_vs_torch"] is None
    assert rows["full"]["same_losses"] and not rows["selective"]["same_losses"]


@pytest.mark.parametrize("flag", ["--rounds", "--iters", "--batch"])
def test_a_count_below_one_is_refused_naming_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        activations.main([flag, "0"])
    assert info.value.code == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
