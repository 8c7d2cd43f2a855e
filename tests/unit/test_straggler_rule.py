"""The straggler statistic: noise is never named; a consistent margin is, with its phase."""

from __future__ import annotations

import random

import pytest

from phalanx.train.phases import PHASES
from phalanx.train.straggler_rule import (
    StragglerDetector,
    StragglerRule,
    _medians_of_others,
    _others,
)

MS = 1e-3
BASE = [2 * MS, 10 * MS, 20 * MS, 3 * MS]  # data, forward, backward, optimizer per step


def _step(rng: random.Random, ranks: int, jitter: float = 0.5 * MS) -> list[list[float]]:
    """One step's report: every rank computes BASE (+ jitter) and waits ~1 ms."""
    return [[b + rng.gauss(0, jitter) for b in BASE] + [MS] for _ in range(ranks)]


def _slow(rows: list[list[float]], rank: int, phase: int, by: float) -> list[list[float]]:
    """``rank`` spends ``by`` more in ``phase``; in lock step the others wait that much more."""
    out = [list(r) for r in rows]
    out[rank][phase] += by
    for r, row in enumerate(out):
        if r != rank:
            row[-1] += by
    return out


def test_noise_with_spikes_is_never_named() -> None:
    # 4 ranks, 2000 steps: Gaussian jitter plus, one step in ten, a 5-40 ms spike on a random
    # rank and phase (a GC pause, a page fault, a noisy neighbour): nothing persists.
    rng = random.Random(0)
    d = StragglerDetector(4)
    for _ in range(2000):
        rows = _step(rng, 4, jitter=1 * MS)
        if rng.random() < 0.1:
            rows = _slow(rows, rng.randrange(4), rng.randrange(4), rng.uniform(5, 40) * MS)
        assert d.observe(rows) is None
        assert d.current is None


def test_a_busy_machine_raises_the_bar() -> None:
    # The same consistent +12 ms: named on a quiet machine, not where steps jitter by ~8 ms.
    for jitter, named in ((0.3 * MS, True), (8 * MS, False)):
        rng = random.Random(1)
        d = StragglerDetector(4)
        for _ in range(40):
            d.observe(_step(rng, 4, jitter))
        found = [d.observe(_slow(_step(rng, 4, jitter), 1, 1, 12 * MS)) for _ in range(8)]
        assert any(f is not None for f in found) is named, jitter


@pytest.mark.parametrize("phase", range(4), ids=PHASES[:4])
def test_a_consistent_margin_names_the_rank_and_its_phase(phase: int) -> None:
    rng = random.Random(phase)
    d = StragglerDetector([10, 11, 12, 13])
    for _ in range(10):
        assert d.observe(_step(rng, 4)) is None
    found = [d.observe(_slow(_step(rng, 4), 2, phase, 30 * MS)) for _ in range(4)]
    assert found[:3] == [None, None, None]  # a few steps prove little
    f = found[3]
    assert f is not None and (f.rank, f.phase, f.windows) == (12, PHASES[phase], 4)
    assert f.excess == pytest.approx(30 * MS, abs=3 * MS)
    assert f"rank 12 is slow in {PHASES[phase]}" in f.describe()
    assert d.observe(_slow(_step(rng, 4), 2, phase, 30 * MS)) is None  # named once per episode
    assert d.current is not None and d.current.rank == 12


def test_two_ranks_the_fast_ranks_wait_is_not_blamed() -> None:
    # With 2 ranks the fast rank waits exactly as long as the slow one computes longer.
    rng = random.Random(2)
    d = StragglerDetector(2)
    for _ in range(10):
        d.observe(_step(rng, 2))
    found = [d.observe(_slow(_step(rng, 2), 0, 1, 25 * MS)) for _ in range(4)]
    f = found[-1]
    assert f is not None and (f.rank, f.phase) == (0, "forward")
    assert f.wait[1] > f.wait[0] + 20 * MS  # the fast rank waited; it is not the one named
    assert "waiting in communication per step: rank 0 1.0 ms, rank 1 26.0 ms" in f.describe()


def test_a_rank_waiting_longer_without_computing_less_is_slow_in_communication() -> None:
    rng = random.Random(3)
    d = StragglerDetector(4)
    for _ in range(10):
        d.observe(_step(rng, 4))
    found = None
    for _ in range(4):
        rows = _step(rng, 4)
        rows[3][-1] += 20 * MS  # its step is longer, and the extra time is waiting
        found = d.observe(rows) or found
    assert found is not None and (found.rank, found.phase) == (3, "communication")


def test_recovery_ends_the_episode_and_a_new_one_is_named_again() -> None:
    rng = random.Random(4)
    d = StragglerDetector(3, StragglerRule(patience=2, warmup=0))
    for _ in range(5):
        d.observe(_step(rng, 3))
    named = [d.observe(_slow(_step(rng, 3), 1, 2, 20 * MS)) for _ in range(3)]
    assert [f is not None for f in named] == [False, True, False]
    d.observe(_step(rng, 3))
    assert d.current is None
    named = [d.observe(_slow(_step(rng, 3), 0, 3, 20 * MS)) for _ in range(2)]
    assert named[1] is not None and (named[1].rank, named[1].phase) == (0, "optimizer")


def test_alternating_spikes_never_build_a_streak() -> None:
    rng = random.Random(5)
    d = StragglerDetector(3, StragglerRule(warmup=0, patience=2))
    for i in range(30):
        assert d.observe(_slow(_step(rng, 3), i % 3, 1, 30 * MS)) is None


def test_warmup_steps_are_ignored() -> None:
    # A straggler from the start: warm-up steps, then one step to learn the noise from, then
    # ``patience`` steps standing out.
    rng = random.Random(6)
    d = StragglerDetector(2, StragglerRule(warmup=2, patience=2))
    found = [d.observe(_slow(_step(rng, 2), 1, 0, 40 * MS)) for _ in range(6)]
    assert [f is not None for f in found] == [False, False, False, False, True, False]


def test_medians_of_others_match_the_direct_computation() -> None:
    rng = random.Random(7)
    for n in range(2, 9):
        values = [rng.random() for _ in range(n)]
        expected = [_others(values, i) for i in range(n)]
        assert _medians_of_others(values) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_ms": 0}, "min_ms must be a number > 0, got 0"),
        ({"relative": -0.1}, "relative must be a number >= 0, got -0.1"),
        ({"z": float("nan")}, "z must be a number >= 0, got nan"),
        ({"quantile": 0.0}, r"quantile must be in \(0, 1\], got 0.0"),
        ({"patience": 0}, "patience must be an int >= 1, got 0"),
        ({"warmup": 1.5}, "warmup must be an int >= 0, got 1.5"),
        ({"history": True}, "history must be an int >= 2, got True"),
    ],
)
def test_bad_rules(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StragglerRule(**kwargs)


def test_bad_reports_and_rank_sets() -> None:
    with pytest.raises(ValueError, match="need >= 2 ranks to compare, got 1"):
        StragglerDetector(1)
    with pytest.raises(ValueError, match=r"expected 2 rows of 5 values .* lengths \[5, 4\]"):
        StragglerDetector(2).observe([[0.0] * 5, [0.0] * 4])
