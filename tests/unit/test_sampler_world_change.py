"""DistributedSampler resumed mid-epoch at another number of replicas (issue 35).

The saving run's ranks, all at position ``k``, consumed the first ``k * R`` entries of the
epoch's global sequence; the resumed sampler deals the rest over its ``R'`` replicas. Each test
replays the saving run's consumption, moves every rank's state through JSON (as a checkpoint
does; a new rank gets rank 0's, as ``checkpoint.load`` gives it) and checks the samples of the
epoch over both runs: every one exactly once, plus the new run's padding, or minus its cut tail.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import pytest

from phalanx.data import DistributedSampler, ElasticSampler
from phalanx.data.elastic_plan import epoch_order

EPOCH = 3
SEED = 11
PAIRS = [(4, 2), (4, 3), (2, 4), (3, 5), (4, 1), (1, 4), (2, 2)]


def _samplers(n: int, world: int, states: list[dict[str, Any]] | None, **kw: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # drop_last with fewer samples than replicas warns
        made = [DistributedSampler(range(n), world, r, seed=SEED, **kw) for r in range(world)]
    for rank, s in enumerate(made):
        if states is not None:
            saved = states[rank] if rank < len(states) else states[0]
            s.load_state_dict(json.loads(json.dumps(saved)))
        s.set_epoch(EPOCH)  # the job's loader does, each pass: it keeps a resumed position
    return made


def _consume(samplers: list[DistributedSampler], steps: int | None, batch: int) -> list[int]:
    """Each rank trains ``steps`` batches (None: the rest of the epoch), in step; returns the
    real samples trained (padding excluded)."""
    trained: list[int] = []
    for s in samplers:
        left = list(s) if s.remaining else []
        assert len(left) == s.remaining
        take = len(left) if steps is None else min(steps * batch, len(left))
        trained += left[: min(take, len(left) - s.padding)]
        s.advance(take)
    return trained


def _steps(samplers: list[DistributedSampler], batch: int) -> int:
    """Batches every rank has left (equal: the ranks step together)."""
    counts = {-(-s.remaining // batch) for s in samplers}
    assert len(counts) == 1, counts
    return counts.pop()


def _check_epoch(trained: list[int], n: int, drop_last: bool) -> None:
    counts = Counter(trained)
    assert max(counts.values(), default=1) == 1, "a sample trained twice in one epoch"
    if not drop_last:
        assert sorted(counts) == list(range(n)), "a sample skipped"


@pytest.mark.parametrize(("old", "new"), PAIRS)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_over_the_old_prefix_and_the_new_rest(
    old: int, new: int, shuffle: bool, drop_last: bool
) -> None:
    batch = 2
    kw = {"shuffle": shuffle, "drop_last": drop_last, "batch_size": batch}
    for n in [1, 5, 16, 23, 46, 61]:
        order = epoch_order(n, SEED, EPOCH, shuffle).tolist()
        for saved_at in range(_steps(_samplers(n, old, None, **kw), batch) + 1):
            before = _samplers(n, old, None, **kw)
            prefix = _consume(before, saved_at, batch)
            after = _samplers(n, new, [s.state_dict() for s in before], **kw)
            consumed = saved_at * batch * old
            if 0 < saved_at < _steps(_samplers(n, old, None, **kw), batch):
                # The saving run's consumed set is exactly the first k*R entries of the order,
                # and the new run deals the rest from there (the same layout: as saved).
                assert sorted(prefix) == sorted(order[:consumed])
                assert {s.consumed for s in before} == {consumed}
                assert {s.start for s in after} == {consumed if new != old else 0}
            assert len({len(s) for s in after}) == 1 and len(after[0]) % batch == 0
            rest = _consume(after, None, batch)
            where = f"n={n}, saved after {saved_at} steps at {old} replicas, resumed at {new}"
            _check_epoch(prefix + rest, n, drop_last)
            if drop_last:  # only the tail of the epoch's order is cut, less than a global batch
                dropped = [i for i in order if i not in set(prefix + rest)]
                assert dropped == order[n - len(dropped) :], where
                assert len(dropped) < max(old, new) * batch, where


def test_the_rest_continues_the_global_order_step_by_step() -> None:
    # 46 samples, 4 replicas x 2: 6 steps (2 padded). Saved after 3 steps: the 2 replicas
    # train entries 24..27, 28..31, ... of the same permutation, then 2 padded wrapping to the
    # epoch's first samples, in 6 steps of 2 x 2.
    n, batch = 46, 2
    before = _samplers(n, 4, None, batch_size=batch)
    _consume(before, 3, batch)
    after = _samplers(n, 2, [s.state_dict() for s in before], batch_size=batch)
    order = epoch_order(n, SEED, EPOCH, True).tolist()
    dealt = [list(s) for s in after]
    assert [len(d) for d in dealt] == [12, 12] and [s.padding for s in after] == [1, 1]
    for step in range(6):
        got = sorted(i for d in dealt for i in d[step * batch : (step + 1) * batch])
        entries = range(24 + step * 4, 24 + (step + 1) * 4)
        assert got == sorted(order[p % n] for p in entries), f"step {step}"
    assert (after[0].start, after[0].total_size) == (24, 48)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_chain_of_world_changes_inside_one_epoch(drop_last: bool) -> None:
    # 4 -> 2 -> 3 -> 1 replicas, saving mid-epoch each time: the state of a resumed epoch
    # (start > 0) carries the count on.
    n, batch, kw = 61, 2, {"drop_last": drop_last, "batch_size": 2}
    samplers, trained, steps = _samplers(n, 4, None, **kw), [], [2, 3, 1]
    for world, take in zip([2, 3, 1], steps):
        trained += _consume(samplers, take, batch)
        samplers = _samplers(n, world, [s.state_dict() for s in samplers], **kw)
    trained += _consume(samplers, None, batch)
    _check_epoch(trained, n, drop_last)
    assert len(trained) == (n - n % batch if drop_last else n)  # one replica at the end
    samplers[0].set_epoch(EPOCH + 1)  # the next epoch is dealt whole
    assert samplers[0].start == 0 and len(samplers[0]) == (n // batch) * batch + (
        0 if drop_last else batch
    )


@pytest.mark.parametrize(("old", "new"), PAIRS)
@pytest.mark.parametrize("mode", ["torch", "uneven", "uneven-drop"])
def test_torchs_layout_and_uneven_shards(old: int, new: int, mode: str) -> None:
    # Without batch_size (torch's counts; the loop takes one index a step) and with
    # even_batches=False (counts differ by one, nothing padded).
    kw: dict[str, Any] = {"even_batches": mode == "torch", "drop_last": mode == "uneven-drop"}
    for n in [3, 12, 17, 30]:  # 12: equal counts at 1..4 replicas, even_batches or not
        ref = _samplers(n, old, None, **kw)
        if len({len(s) for s in ref}) > 1:
            continue  # ranks with unequal batch counts cannot step together
        for saved_at in range(len(ref[0]) + 1):
            before = _samplers(n, old, None, **kw)
            prefix = _consume(before, saved_at, 1)
            after = _samplers(n, new, [s.state_dict() for s in before], **kw)
            _check_epoch(prefix + _consume(after, None, 1), n, bool(kw["drop_last"]))


def test_same_world_state_loads_as_saved() -> None:
    # The layout is unchanged: the state, saved again, is the saving run's (bitwise resumes).
    before = _samplers(46, 4, None, batch_size=2)
    _consume(before, 2, 2)
    after = _samplers(46, 2, [s.state_dict() for s in before], batch_size=2)
    _consume(after, 1, 2)
    again = _samplers(46, 2, [s.state_dict() for s in after], batch_size=2)
    assert [s.state_dict() for s in again] == [s.state_dict() for s in after]
    assert again[0].state_dict()["start"] == 16 and again[0].position == 2


def test_a_state_saved_before_start_was_recorded_loads_at_another_world() -> None:
    before = _samplers(46, 4, None, batch_size=2)
    prefix = _consume(before, 3, 2)
    old_format = [{k: v for k, v in s.state_dict().items() if k != "start"} for s in before]
    after = _samplers(46, 2, old_format, batch_size=2)
    _check_epoch(prefix + _consume(after, None, 2), 46, drop_last=False)


def test_a_live_jobs_elastic_state_continues_at_its_cursor() -> None:
    # A Job(recovery='live') checkpoint holds an ElasticSampler state: its cursor counts the
    # entries of the same permutation its committed steps consumed.
    n = 46
    elastic = ElasticSampler(range(n), 8, 4, 0, seed=SEED)
    elastic.set_epoch(EPOCH)
    prefix = []
    for _ in range(3):
        plan = elastic.plan()
        assert plan is not None
        prefix += [i for r in range(4) for i in elastic.indices(plan, r)]
        elastic.commit(plan)
    after = _samplers(n, 3, [elastic.state_dict()], batch_size=2)
    assert after[0].start == 24
    _check_epoch(prefix + _consume(after, None, 2), n, drop_last=False)


def test_finished_epoch_stays_finished_even_where_it_deals_nothing() -> None:
    # 3 samples with drop_last: 3 replicas deal one each, 4 replicas none.
    done = _samplers(3, 3, None, drop_last=True)
    _consume(done, None, 1)
    empty = _samplers(3, 4, [s.state_dict() for s in done], drop_last=True)
    assert all(s.remaining == 0 for s in empty)
    back = _samplers(3, 1, [s.state_dict() for s in empty], drop_last=True)
    assert back[0].remaining == 0  # not the whole epoch again


def test_finished_resumed_epoch_read_again_is_read_whole() -> None:
    before = _samplers(20, 4, None, batch_size=1)
    _consume(before, 2, 1)
    after = _samplers(20, 2, [s.state_dict() for s in before], batch_size=1)
    _consume(after, None, 1)
    assert len(list(after[0])) == 10  # torch's sampler reads an epoch again, whole


def test_what_cannot_continue_says_why_and_what_to_do() -> None:
    before = _samplers(46, 4, None, batch_size=2)
    _consume(before, 3, 2)
    state = before[0].state_dict()
    other = DistributedSampler(range(40), 2, 0, seed=SEED, batch_size=2)
    with pytest.raises(ValueError, match=r"dataset_len=46 .*dataset_len=40.*over the dataset"):
        other.load_state_dict(state)
    unshuffled = DistributedSampler(range(46), 2, 0, shuffle=False, batch_size=2)
    with pytest.raises(ValueError, match=r"first 24 entries .*shuffle=True.*shuffle=False"):
        unshuffled.load_state_dict(state)
    with pytest.raises(ValueError, match=r"position=6 but no 'num_replicas'"):
        other.load_state_dict({"epoch": 3, "position": 6})
    with pytest.raises(ValueError, match=r"position'\]=13 exceeds .*num_samples'\]=12"):
        other.load_state_dict({**state, "position": 13})
    assert (other.epoch, other.position, other.start) == (0, 0, 0)  # unchanged by a refusal
    # At an epoch's start any data loads (nothing of the epoch is consumed).
    other.load_state_dict({**state, "position": 0})
    assert (other.epoch, other.position) == (3, 0)
