"""Clock alignment math: NTP's four timestamps, the shortest round trip, interpolation."""

from __future__ import annotations

import pytest

from phalanx.diagnostics.clock_math import ClockModel, ClockSample, best, ntp_sample


def _exchange(
    offset: float, there: float, back: float, turn: float, t1: float = 100.0
) -> tuple[float, float, float, float]:
    """Readings of one exchange: rank 0's clock is the client's plus ``offset``; the legs take
    ``there`` and ``back`` seconds, rank 0 answers after ``turn``."""
    t2 = t1 + there + offset
    t3 = t2 + turn
    t4 = t3 - offset + back
    return t1, t2, t3, t4


def test_equal_legs_give_the_exact_offset_and_the_round_trip_without_the_turnaround() -> None:
    s = ntp_sample(*_exchange(offset=2.5, there=0.001, back=0.001, turn=0.004))
    assert s.offset == pytest.approx(2.5, abs=1e-9)
    assert s.rtt == pytest.approx(0.002, abs=1e-9)
    assert s.at == pytest.approx(100.0 + 0.003, abs=1e-9)  # the round trip's middle


@pytest.mark.parametrize(("there", "back"), [(0.0, 0.003), (0.003, 0.0), (0.0005, 0.0025)])
def test_unequal_legs_err_by_at_most_half_the_round_trip(there: float, back: float) -> None:
    s = ntp_sample(*_exchange(offset=-7.0, there=there, back=back, turn=0.01))
    assert abs(s.offset - (-7.0)) <= s.error + 1e-12
    assert s.offset - (-7.0) == pytest.approx((there - back) / 2, abs=1e-9)


def test_best_keeps_the_shortest_round_trip() -> None:
    samples = [ntp_sample(*_exchange(1.0, a, b, 0.001)) for a, b in [(0.01, 0.0), (1e-4, 1e-4)]]
    chosen = best(samples)
    assert chosen.rtt == pytest.approx(2e-4) and chosen.offset == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no clock samples"):
        best([])


def test_the_model_interpolates_between_samples_and_holds_outside() -> None:
    model = ClockModel([ClockSample(20.0, 3.0, 0.002), ClockSample(10.0, 1.0, 0.0004)])
    assert model.offset_at(0.0) == 1.0  # before the first: held
    assert model.offset_at(15.0) == pytest.approx(2.0)  # halfway: a straight line
    assert model.offset_at(99.0) == 3.0  # after the last: held
    assert model.align(15.0) == pytest.approx(17.0)
    assert model.error == pytest.approx(0.001)  # the largest rtt / 2
    assert model.drift == pytest.approx(2.0)


def test_no_samples_is_the_identity_with_no_error() -> None:
    model = ClockModel()
    assert model.align(5.0) == 5.0 and model.error == 0.0 and model.drift == 0.0
