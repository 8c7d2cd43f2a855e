"""The critical path on synthetic runs: the delayed rank and phase are named, per step."""

from __future__ import annotations

import itertools

import pytest

from phalanx.diagnostics.critical_path import COMMUNICATION, critical_path
from phalanx.diagnostics.merge import merge_logs
from tests.unit import timeline_sim as sim

SKEW = {1: 0.4, 2: -1.3, 3: 7.0}  # the ranks' clocks disagree by seconds: merging aligns them


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "optimizer"])
@pytest.mark.parametrize("buckets", [1, 3])
def test_a_delayed_phase_is_the_critical_rank_and_phase_of_its_step(
    phase: str, buckets: int
) -> None:
    delays = {3: (2, phase, 0.040), 6: (0, phase, 0.030), 7: (3, phase, 0.050)}
    run = merge_logs(sim.ddp(4, 9, delays, skew=SKEW, buckets=buckets))
    steps = {s.step: s for s in critical_path(run.ranks).steps}
    assert sorted(steps) == list(range(1, 10))
    for n, (rank, ph, seconds) in delays.items():
        assert (steps[n].rank, steps[n].phase) == (rank, ph), steps[n]
        # the path holds the phase up to the collective, the typical time the whole phase
        assert steps[n].excess == pytest.approx(seconds, abs=sim.BASE_S[ph] + 1e-3)
    for n in set(steps) - set(delays) - {d + 1 for d in delays}:
        assert steps[n].excess < 2e-3, steps[n]  # nobody stands out in an undisturbed step


def test_the_others_wait_as_long_as_the_delay() -> None:
    run = merge_logs(sim.ddp(4, 4, {2: (1, "forward", 0.030)}, skew=SKEW))
    step = critical_path(run.ranks).steps[1]
    assert step.step == 2 and step.rank == 1
    assert step.others_waited == pytest.approx(0.030, abs=2e-3)
    assert step.waited[1] < 1e-3  # the late rank itself hardly waits


def test_back_to_back_delays_before_each_collective_are_each_named() -> None:
    phases = ("data", "forward", "backward")
    delays = {n: (n % 4, phases[n % 3], 0.03 + 0.002 * n) for n in range(1, 9)}
    run = merge_logs(sim.ddp(4, 8, delays, skew=SKEW))
    steps = {s.step: s for s in critical_path(run.ranks).steps}
    assert {n: (s.rank, s.phase) for n, s in steps.items()} == {
        n: (r, p) for n, (r, p, _) in delays.items()
    }


def test_a_delay_that_a_longer_one_hides_is_off_the_path() -> None:
    # rank 1's slow optimizer (step 1) and rank 2's slower data loading (step 2) both end at
    # step 2's all-reduce: the others waited for rank 2 only, so rank 1 had slack
    run = merge_logs(sim.ddp(4, 3, {1: (1, "optimizer", 0.02), 2: (2, "data", 0.04)}))
    steps = {s.step: s for s in critical_path(run.ranks).steps}
    assert (steps[2].rank, steps[2].phase) == (2, "data")
    assert steps[1].rank != 1 and steps[1].excess < 2e-3


def test_the_path_jumps_to_the_late_rank_at_its_arrival() -> None:
    # rank 0 is late in step 3 (so the walk reaches step 2 on rank 0), rank 2 in step 2
    run = merge_logs(sim.ddp(3, 3, {2: (2, "backward", 0.05), 3: (0, "forward", 0.005)}))
    path = critical_path(run.ranks)
    assert any(j.to_rank == 2 and j.key == "0#2" for j in path.jumps)
    pieces = [p for p in path.pieces if p.step == 2]
    assert sum(p.end - p.start for p in pieces if (p.rank, p.phase) == (2, "backward")) > 0.05
    # the path never runs backwards in time: its stretches do not overlap
    ordered = sorted(path.pieces, key=lambda p: p.start)
    assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(ordered))


@pytest.mark.parametrize(("rank", "phase"), [(0, "forward"), (1, "backward"), (1, "forward")])
def test_pipeline_stages_pass_the_path_through_point_to_point_waits(rank: int, phase: str) -> None:
    run = merge_logs(sim.pipeline(5, {3: (rank, phase, 0.04)}))
    steps = {s.step: s for s in critical_path(run.ranks).steps}
    assert (steps[3].rank, steps[3].phase) == (rank, phase)
    assert steps[3].excess == pytest.approx(0.04, abs=3e-3)


def test_a_wait_nobody_caused_is_communication_on_the_path() -> None:
    # one rank alone: its waits are released by itself (the transfer), never a jump
    run = merge_logs(sim.ddp(1, 3, {}))
    path = critical_path(run.ranks)
    assert path.jumps == []
    assert {p.rank for p in path.pieces} == {0}
    assert all(p.phase != COMMUNICATION or p.end - p.start <= 1e-3 for p in path.pieces)


def test_merging_aligns_skewed_clocks() -> None:
    run = merge_logs(sim.ddp(4, 2, {}, skew=SKEW))
    starts = {r: tl.segments[0].start for r, tl in run.ranks.items()}
    assert max(starts.values()) - min(starts.values()) < 1e-9  # all began at true time 0
    ops = {r: [o.key for o in tl.ops] for r, tl in run.ranks.items()}
    assert all(keys == ops[0] for keys in ops.values())
    assert all(o.last_rank is not None for tl in run.ranks.values() for o in tl.ops)


def test_an_empty_run_has_no_path() -> None:
    path = critical_path({})
    assert path.pieces == [] and path.steps == []
