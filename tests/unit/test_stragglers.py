"""The straggler rule: consistent slowness is named, spikes and equal ranks are not."""

from __future__ import annotations

import pytest

from phalanx.train.stragglers import StragglerDetector

WAIT = [0.0, 0.0, 0.0]


def test_consistent_1_5x_is_named_after_patience() -> None:
    d = StragglerDetector(3, threshold=1.2, patience=2)
    assert d.observe([0.010, 0.015, 0.010], WAIT) is None  # one report proves little
    found = d.observe([0.010, 0.0151, 0.0099], WAIT)
    assert found is not None and found.rank == 1
    assert found.factor == pytest.approx(0.0151 / 0.00995)
    assert "rank 1 is 1.52x slower" in found.describe()


def test_one_off_spikes_and_equal_ranks_are_not_named() -> None:
    d = StragglerDetector(3, patience=2)
    reports = [
        [0.010, 0.010, 0.010],
        [0.030, 0.010, 0.010],  # rank 0 spikes once
        [0.010, 0.010, 0.011],
        [0.010, 0.030, 0.010],  # rank 1 spikes once
        [0.010, 0.010, 0.010],
        [0.010, 0.010, 0.030],  # rank 2 once ...
        [0.030, 0.010, 0.010],  # ... then another rank: no streak
    ]
    assert [d.observe(r, WAIT) for r in reports] == [None] * len(reports)


def test_two_ranks_compare_with_each_other() -> None:
    d = StragglerDetector(2, patience=1)
    found = d.observe([0.02, 0.01], [0.0, 0.01])
    assert found is not None and found.rank == 0 and found.factor == pytest.approx(2.0)
    assert "rank 1 10.0 ms" in found.describe()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 1}, "world_size must be >= 2"),
        ({"world_size": 2, "threshold": 1.0}, "threshold must be > 1, got 1.0"),
        ({"world_size": 2, "patience": 0}, "patience must be >= 1, got 0"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StragglerDetector(**kwargs)


def test_report_size_checked() -> None:
    with pytest.raises(ValueError, match="expected 2 values per report, got 3 compute"):
        StragglerDetector(2).observe([1.0, 1.0, 1.0], [0.0, 0.0])
