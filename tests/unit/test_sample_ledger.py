"""SampleLedger: names missing, repeated and wrongly trained samples; compact; JSON round trip."""

from __future__ import annotations

import json
import random

import pytest

from phalanx.data import ElasticSampler, SampleLedger
from phalanx.data.elastic_plan import epoch_order


def _run(n: int, g: int, world: int, steps: int, **kw: object) -> SampleLedger:
    """A fault-free run of ``steps`` steps at ``world`` ranks, recording the planned ids."""
    ranks = [ElasticSampler(range(n), g, world, r, **kw) for r in range(world)]  # type: ignore[arg-type]
    ledger = SampleLedger.for_sampler(ranks[0])
    for _ in range(steps):
        plans = [s.commit() for s in ranks]
        for r, (s, plan) in enumerate(zip(ranks, plans, strict=True)):
            ledger.record(plan.step, plan.epoch, r, s.indices(plan, r))
    return ledger


def test_names_missing_and_repeated_samples_with_their_steps() -> None:
    order = epoch_order(20, 5, 0, shuffle=True).tolist()
    ledger = SampleLedger(20, seed=5, shuffle=True)
    ledger.record(0, 0, 0, order[0:5])
    ledger.record(0, 0, 1, order[5:10])
    ledger.record(1, 0, 0, order[10:15])
    ledger.record(1, 0, 1, [*order[15:19], order[3]])  # order[19] never; order[3] twice
    audit = ledger.audit(0)
    assert not audit.ok and audit.trained == 20
    assert audit.missing == (order[19],)
    assert audit.repeated == {order[3]: ((0, 0), (1, 1))}
    assert ledger.problems() == [
        f"epoch 0: 1 sample(s) [{order[19]}] never trained (missing)",
        f"epoch 0: 1 sample(s) [{order[3]} at (step, rank) [(0, 0), (1, 1)]] trained more "
        f"than once",
    ]


def test_a_redone_step_recorded_twice_is_caught() -> None:
    ledger = _run(30, 6, 3, 5, seed=1)
    assert ledger.problems() == []
    s = ElasticSampler(range(30), 6, 3, 2, seed=1)
    plan = s.plan()
    assert plan is not None
    ledger.record(plan.step, plan.epoch, 2, s.indices(plan))  # step 0's rank 2, again
    (line,) = ledger.problems()
    assert line.startswith("epoch 0: 2 sample(s) [") and "[(0, 2), (0, 2)]" in line


def test_drop_last_tail_is_not_missing_but_must_not_be_trained() -> None:
    n, g = 26, 8  # 3 steps, 2 samples left out
    ledger = _run(n, g, 2, 3, drop_last=True, seed=2)
    assert ledger.used_per_epoch == 24 and ledger.problems() == []
    tail = epoch_order(n, 2, 0, shuffle=True).tolist()[24:]
    ledger.record(2, 0, 1, tail[:1])
    assert ledger.audit(0).unexpected == (tail[0],)
    assert ledger.problems() == [f"epoch 0: 1 sample(s) [{tail[0]}] trained but dropped"]


def test_incomplete_epoch_lists_what_is_still_to_train() -> None:
    ledger = _run(12, 4, 2, 2, shuffle=False)  # 2 of 3 steps
    assert ledger.audit(0).missing == (8, 9, 10, 11)
    assert ledger.problems(epochs=[]) == []


def test_long_lists_are_cut_in_messages() -> None:
    ledger = SampleLedger(100, seed=0, shuffle=False)
    ledger.record(0, 0, 0, [0])
    (line,) = ledger.problems()
    assert line.startswith("epoch 0: 99 sample(s) [1, 2, 3,") and "... and 79 more]" in line


def test_ids_round_trip_through_json_whatever_their_order() -> None:
    rng = random.Random(7)
    ledger = SampleLedger(50, seed=3, shuffle=True)
    recorded = []
    for step in range(6):
        for rank in range(2):
            ids = rng.sample(range(50), rng.randint(0, 9))  # not runs of the order: stored as is
            ledger.record(step, step // 3, rank, ids)
            recorded.append((step, step // 3, rank, ids))
    text = json.dumps(ledger.to_dict())
    back = SampleLedger.from_dict(json.loads(text))
    assert list(back.entries()) == list(ledger.entries()) == sorted(recorded)
    assert back.problems() == ledger.problems() and back.epochs == [0, 1]


def test_runs_make_it_compact() -> None:
    n, g, world = 10_000, 64, 4  # 157 steps, the last one 16 samples
    ledger = _run(n, g, world, 157, seed=11)
    assert ledger.problems() == []
    data = ledger.to_dict()
    ints = sum(2 + sum(len(r) for r in ranks) for _, _, ranks in data["steps"])
    assert ints == 157 * (2 + 3 * world)  # one run per rank and step, shuffled or not
    size = len(json.dumps(data, separators=(",", ":")))
    assert size < 157 * (2 + 3 * world) * 7  # at most 6 digits and a comma per integer


def test_merge_of_the_ranks_ledgers() -> None:
    ranks = [ElasticSampler(range(9), 3, 3, r, shuffle=False) for r in range(3)]
    ledgers = [SampleLedger.for_sampler(s) for s in ranks]
    for _ in range(3):
        for r, s in enumerate(ranks):
            plan = s.commit()
            ledgers[r].record(plan.step, plan.epoch, r, s.indices(plan, r))
    assert ledgers[0].audit(0).missing == (1, 2, 4, 5, 7, 8)
    for other in ledgers[1:]:
        ledgers[0].merge(other)
    assert ledgers[0].problems() == []


def test_bad_input_is_named() -> None:
    ledger = SampleLedger(10, seed=0, shuffle=True)
    with pytest.raises(ValueError, match=r"ids 2 sample\(s\) \[10, -1\] of step=3, rank=1 .*=10"):
        ledger.record(3, 0, 1, [4, 10, -1])
    with pytest.raises(ValueError, match=r"record\(step=-1\): step must be an int >= 0"):
        ledger.record(-1, 0, 0, [1])
    with pytest.raises(TypeError, match=r"SampleLedger\(shuffle='yes'\)"):
        SampleLedger(10, seed=0, shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"used_per_epoch=11 exceeds dataset_len=10"):
        SampleLedger(10, seed=0, shuffle=True, used_per_epoch=11)
    with pytest.raises(ValueError, match=r"merge: other=.*'seed': 1.* another order"):
        ledger.merge(SampleLedger(10, seed=1, shuffle=True))
    with pytest.raises(ValueError, match=r"not a 'phalanx.sample_ledger/1' ledger"):
        SampleLedger.from_dict({"steps": []})
    data = ledger.to_dict()
    with pytest.raises(ValueError, match=r"malformed ledger .*runs \[4\] are not pairs"):
        SampleLedger.from_dict({**data, "steps": [[0, 0, [[0, 4]]]]})
    with pytest.raises(ValueError, match=r"step 0 rank 1: runs \[8, 3\] reach past .*=10"):
        SampleLedger.from_dict({**data, "steps": [[0, 0, [[1, 8, 3]]]]})
    with pytest.raises(TypeError, match=r"record\(ids=\[1, 'a'\]\): ids\[1\] must be an int"):
        ledger.record(0, 0, 0, [1, "a"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"malformed ledger \('seed'\)"):
        SampleLedger.from_dict({k: v for k, v in data.items() if k != "seed"})


def test_forget_from_drops_that_step_and_every_later_one() -> None:
    # 20 samples, global batch 4: 5 steps an epoch; 7 steps run (epoch 1 has steps 0 and 1).
    ledger = _run(20, 4, 2, 7, shuffle=True, seed=1)
    kept = [(s, e) for s, e, r, _ in ledger.entries() if (e, s) < (0, 3)]
    ledger.forget_from(0, 3)
    assert (
        [(s, e) for s, e, _, _ in ledger.entries()] == kept == [(s, 0) for s in (0, 0, 1, 1, 2, 2)]
    )
    assert ledger.epochs == [0]
    # Redoing steps 3 and 4 completes epoch 0 exactly once again.
    again = _run(20, 4, 2, 5, shuffle=True, seed=1)
    for s, e, r, ids in again.entries():
        if s >= 3:
            ledger.record(s, e, r, ids)
    assert ledger.problems(epochs=[0]) == []
    with pytest.raises(ValueError, match=r"SampleLedger.forget_from\(step=-1\)"):
        ledger.forget_from(0, -1)
