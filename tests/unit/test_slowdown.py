"""Slowdown (the injected straggler): who is slow, and by how much."""

from __future__ import annotations

import time

import pytest

from phalanx.train.slowdown import Slowdown


def test_fixed_straggler_sleeps_factor_minus_one_times_the_work() -> None:
    slow = Slowdown(3.0, 1, index=1, count=2)
    fast = Slowdown(3.0, 1, index=0, count=2)
    for s in (slow, fast):
        s.begin()
        time.sleep(0.02)
    assert fast.end(0) == 0.0
    pause = slow.end(0)
    assert pause >= 2 * 0.02 and slow.slept == pause


def test_random_straggler_is_agreed_and_varies() -> None:
    ranks = [Slowdown(2.0, "random", index=i, count=3, seed=7) for i in range(3)]
    draws = [[r.slow_at(step) for step in range(50)] for r in ranks]
    assert draws[0] == draws[1] == draws[2]
    assert set(draws[0]) == {0, 1, 2}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"factor": 0.5, "who": 0}, "factor must be >= 1, got 0.5"),
        ({"factor": 2.0, "who": 3}, r"who=3 must be 'random' or a participant index in \[0, 2\)"),
        ({"factor": 2.0, "who": "some"}, "who='some'"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Slowdown(**kwargs, index=0, count=2)
