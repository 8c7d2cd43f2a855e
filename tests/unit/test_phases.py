"""The phase clock: time between marks goes to the open phase, waits inside it are taken out."""

from __future__ import annotations

import time

import pytest

from phalanx.comm import wait_clock
from phalanx.train.phases import PhaseClock


class _Fake:
    """A clock and a wait counter the test moves by hand."""

    def __init__(self) -> None:
        self.t = self.w = 0.0


def _clock() -> tuple[PhaseClock, _Fake]:
    fake = _Fake()
    return PhaseClock(waited=lambda: fake.w, now=lambda: fake.t), fake


def test_waits_are_taken_out_of_the_phase_they_happen_in() -> None:
    clock, fake = _clock()
    clock.enter("data")
    fake.t = 1.0
    clock.enter("forward")
    fake.t, fake.w = 3.0, 0.5  # forward lasted 2 s, 0.5 s of it waiting (ZeRO-3's gather)
    clock.enter("backward")
    fake.t, fake.w = 7.0, 3.5  # backward 4 s, 3 s waiting in the all-reduce
    clock.enter("optimizer")
    fake.t = 8.0
    clock.enter(None)
    fake.t, fake.w = 20.0, 9.0  # untimed (the monitor, between jobs): neither counted
    clock.enter("data")
    assert clock.take() == [1.0, 1.5, 1.0, 1.0, 3.5]
    assert clock.take() == [0.0, 0.0, 0.0, 0.0, 0.0]
    shares = clock.shares()
    assert shares["communication_share"] == pytest.approx(3.5 / 8)
    assert shares["backward_share"] == pytest.approx(1 / 8)


def test_a_wait_longer_than_its_phase_is_capped() -> None:
    clock, fake = _clock()  # another thread's waits overlapping this phase
    clock.enter("backward")
    fake.t, fake.w = 1.0, 5.0
    clock.enter(None)
    assert clock.take() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_relabel_gives_the_open_stretch_to_another_phase() -> None:
    clock, fake = _clock()
    clock.enter("data")
    fake.t = 2.0
    clock.relabel("forward")  # no progress(): loading and forward were one stretch
    clock.enter("backward")
    assert clock.take()[:2] == [0.0, 2.0]


def test_bad_phase_names() -> None:
    clock, _ = _clock()
    with pytest.raises(ValueError, match=r"phase must be one of .* got 'comm'"):
        clock.enter("comm")
    with pytest.raises(ValueError, match="got None"):
        clock.relabel(None)  # type: ignore[arg-type]


def test_wait_clock_counts_nested_waits_once() -> None:
    before = wait_clock.waited()
    with wait_clock.blocked(), wait_clock.blocked():  # DDP's future around a tracked work
        time.sleep(0.05)
    assert 0.05 <= wait_clock.waited() - before < 0.095  # twice would be >= 0.1
    wait_clock.add(0.25)
    assert 0.3 <= wait_clock.waited() - before < 0.345
