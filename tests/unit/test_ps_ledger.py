"""Parameter-server ledger: exactly-once acceptance, staleness histogram, the SSP rule."""

from __future__ import annotations

import random

import pytest

from phalanx.parameter_server import Ledger, may_proceed, slowest


def test_duplicates_rejected_per_worker() -> None:
    ledger = Ledger()
    assert ledger.accept(0, 5)
    assert not ledger.accept(0, 5)
    assert ledger.accept(1, 5)  # another worker's step 5 is a different update
    assert ledger.accept(0, 4) and ledger.accept(0, 6)
    assert not ledger.accept(0, 4) and not ledger.accept(0, 6)
    assert ledger.accepted(0) == 3 and ledger.accepted(1) == 1 and ledger.accepted(9) == 0


def test_accept_matches_a_plain_set_on_random_streams() -> None:
    rng = random.Random(1)
    for _ in range(50):
        ledger, seen = Ledger(), set()
        for _ in range(300):
            # mostly in order with resends and replays, as retries and restarts produce
            key = (rng.randint(0, 2), rng.choice([rng.randint(0, 40), rng.randint(0, 8)]))
            assert ledger.accept(*key) == (key not in seen), key
            seen.add(key)
        for worker in range(3):
            assert ledger.accepted(worker) == sum(1 for w, _ in seen if w == worker)


def test_in_order_stream_stays_compact() -> None:
    ledger = Ledger()
    for step in range(10_000):
        assert ledger.accept(2, step)
    assert ledger.accepted(2) == 10_000
    assert not ledger._steps[2].sparse  # in-order steps cost no memory per step


def test_staleness_histogram() -> None:
    ledger = Ledger()
    assert ledger.record(0, pulled_version=3, server_version=3) == 0
    assert ledger.record(0, 1, 3) == 2
    assert ledger.record(1, 1, 3) == 2
    assert ledger.record(1, 0, 5) == 5
    assert ledger.histogram() == {0: 1, 2: 2, 5: 1}
    assert list(ledger.histogram()) == [0, 2, 5]
    assert ledger.histogram(worker=1) == {2: 1, 5: 1}
    assert ledger.histogram(worker=7) == {}
    assert ledger.max_staleness() == 5
    assert Ledger().max_staleness() == 0


def test_ledger_errors() -> None:
    ledger = Ledger()
    with pytest.raises(
        ValueError, match="worker 2: pulled_version=4 is newer than server_version=3"
    ):
        ledger.record(2, 4, 3)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        ledger.accept(0, -1)
    with pytest.raises(ValueError, match="worker must be >= 0, got -2"):
        ledger.accept(-2, 0)
    with pytest.raises(ValueError, match="pulled_version must be >= 0, got -1"):
        ledger.record(0, -1, 3)


def test_ssp_rule() -> None:
    clocks = {0: 10, 1: 12, 2: 13}
    assert may_proceed(12, clocks, bound=2)
    assert not may_proceed(13, clocks, bound=2)  # 3 clocks ahead of worker 0
    assert may_proceed(13, clocks, bound=3)
    # bound 0 is bulk-synchronous: only workers level with the slowest go on
    assert may_proceed(10, clocks, bound=0)
    assert not may_proceed(11, clocks, bound=0)
    assert may_proceed(4, {0: 4, 1: 4}, bound=0)


def test_dead_workers_excluded_from_the_slowest() -> None:
    clocks = {0: 3, 1: 12, 2: 10, 3: 10}
    assert slowest(clocks, alive=[0, 1, 2, 3]) == 0
    assert slowest(clocks, alive=[1, 2, 3]) == 2  # tie between 2 and 3: lowest index
    assert not may_proceed(12, clocks, bound=2)  # worker 0 (alive by default) holds it back
    assert may_proceed(12, clocks, bound=2, alive={1, 2, 3})
    assert not may_proceed(12, clocks, bound=1, alive={1, 2, 3})


def test_ssp_errors() -> None:
    with pytest.raises(ValueError, match=r"no live worker among clocks for workers \[0, 1\]"):
        slowest({0: 1, 1: 2}, alive=[])
    with pytest.raises(ValueError, match=r"alive workers \[5\] have no entry in clocks"):
        slowest({0: 1}, alive=[0, 5])
    with pytest.raises(ValueError, match="bound must be >= 0, got -1"):
        may_proceed(1, {0: 1}, bound=-1)
