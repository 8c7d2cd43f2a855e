"""phalanx.DistributedSampler: torch's order, coverage, even batches, padding, resume, errors."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import phalanx
from phalanx.data import DistributedSampler

SIZES = range(1, 51)
WORLDS = range(1, 6)


def _ranks(n: int, world: int, **kw: object) -> list[DistributedSampler]:
    return [DistributedSampler(range(n), world, r, **kw) for r in range(world)]  # type: ignore[arg-type]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_order_as_torch(shuffle: bool, drop_last: bool) -> None:
    for n, world in itertools.product([0, 1, 2, 5, 7, 16, 33], [1, 2, 3, 4]):
        for rank, epoch in itertools.product(range(world), [0, 1, 5]):
            ours = DistributedSampler(range(n), world, rank, shuffle, 7, drop_last)
            theirs = TorchSampler(range(n), world, rank, shuffle, 7, drop_last)  # type: ignore[arg-type]
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


def _check_padded_cover(samplers: list[DistributedSampler], n: int) -> None:
    """Every sample at least once; the duplicates are exactly the rank's last `padding` ones."""
    real: list[int] = []
    for s in samplers:
        indices = list(s)
        assert len(indices) == len(s)
        real += indices[: len(indices) - s.padding]
    assert sorted(real) == list(range(n))  # exactly once, padding excluded
    assert sum(len(s) for s in samplers) - sum(s.padding for s in samplers) == n


def test_every_sample_once_plus_padding() -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        samplers = _ranks(n, world, seed=1)
        assert len({len(s) for s in samplers}) == 1
        _check_padded_cover(samplers, n)
        assert sum(s.padding for s in samplers) == samplers[0].total_size - n < world


def test_drop_last_sees_each_at_most_once() -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        if n < world:
            continue
        samplers = _ranks(n, world, seed=2, drop_last=True)
        seen = Counter(i for s in samplers for i in s)
        assert max(seen.values()) == 1 and all(s.padding == 0 for s in samplers)
        assert len(seen) == n - n % world  # the dropped tail: n % world samples


@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_even_batches_equal_full_batches(batch_size: int) -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        samplers = _ranks(n, world, seed=3, batch_size=batch_size)
        lengths = {len(s) for s in samplers}
        assert lengths == {math.ceil(n / (world * batch_size)) * batch_size}  # no rank hangs
        _check_padded_cover(samplers, n)
        assert sum(s.padding for s in samplers) < world * batch_size


def test_even_batches_with_drop_last_cuts_to_full_batches() -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        if n < world * 4:  # nothing left: every rank yields nothing (as torch's drop_last)
            with pytest.warns(UserWarning, match=r"drops all \d+ samples .*batch_size"):
                assert (
                    list(DistributedSampler(range(n), world, 0, drop_last=True, batch_size=4)) == []
                )
            continue
        samplers = _ranks(n, world, drop_last=True, batch_size=4)
        assert {len(s) for s in samplers} == {(n // (world * 4)) * 4}
        seen = Counter(i for s in samplers for i in s)
        assert max(seen.values()) == 1 and len(seen) == (n // (world * 4)) * world * 4


def test_even_batches_extends_torch_order() -> None:
    ours = DistributedSampler(range(10), 3, 1, seed=4, batch_size=4)
    theirs = TorchSampler(range(10), 3, 1, seed=4)  # type: ignore[arg-type]
    assert list(ours)[: len(theirs)] == list(theirs)


def test_uneven_mode_has_no_duplicates() -> None:
    for n, world in itertools.product(SIZES, WORLDS):
        samplers = _ranks(n, world, even_batches=False, batch_size=4)
        assert sorted(i for s in samplers for i in s) == list(range(n))
        assert max(len(s) for s in samplers) - min(len(s) for s in samplers) <= 1


def test_epochs_differ_and_seed_repeats() -> None:
    a = DistributedSampler(range(100), 2, 0, seed=5)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b = DistributedSampler(range(100), 2, 0, seed=5)
    assert list(b) == first
    b.set_epoch(1)
    assert list(b) == list(a)
    assert list(DistributedSampler(range(100), 2, 0, seed=6)) != first


def test_resume_mid_epoch() -> None:
    full = DistributedSampler(range(50), 3, 2, seed=8, batch_size=4)
    full.set_epoch(3)
    expected = list(full)
    run = DistributedSampler(range(50), 3, 2, seed=8, batch_size=4)
    run.set_epoch(3)
    for _ in range(2):
        run.advance(4)
    state = json.loads(json.dumps(run.state_dict()))
    assert (state["epoch"], state["position"], state["seed"]) == (3, 8, 8)
    resumed = DistributedSampler(range(50), 3, 2, seed=0, batch_size=4)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the loop re-enters the same epoch: the position survives
    assert list(resumed) == expected[8:] and resumed.remaining == len(expected) - 8
    resumed.set_epoch(4)
    assert resumed.position == 0 and len(list(resumed)) == len(expected)


def test_finished_epoch_restarts_on_next_iter() -> None:
    s = DistributedSampler(range(6), 2, 0, shuffle=False)
    s.advance(len(s))
    assert list(s) == [0, 2, 4]


def test_errors_name_values() -> None:
    with pytest.raises(ValueError, match=r"rank=2.*num_replicas=2"):
        DistributedSampler(range(4), 2, 2)
    with pytest.raises(ValueError, match=r"rank=-1.*num_replicas=2"):
        DistributedSampler(range(4), 2, -1)
    with pytest.raises(ValueError, match=r"rank=0.*num_replicas=0"):
        DistributedSampler(range(4), 0, 0)
    with pytest.raises(TypeError, match=r"num_replicas must be an int, got float 2\.0"):
        DistributedSampler(range(4), 2.0, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rank must be an int, got str '1'"):
        DistributedSampler(range(4), 2, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got int 0"):
        DistributedSampler(range(3), 1, 0, batch_size=0)
    s = DistributedSampler(range(4), 2, 0)
    with pytest.raises(ValueError, match=r"n_samples=3.*\[0, 2\]"):
        s.advance(3)
    s.advance(1)
    other = DistributedSampler(range(4), 2, 0, shuffle=False)  # another order of the same data
    with pytest.raises(ValueError, match=r"cannot resume mid-epoch at position=1.*shuffle=True"):
        other.load_state_dict(s.state_dict())


def test_defaults_need_a_process_group_as_torchs_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"num_replicas=None .* has not been initialized"):
        DistributedSampler(range(5))  # torch's raises too: never the whole dataset everywhere
    with pytest.raises(ValueError, match=r"rank=None .* has not been initialized"):
        DistributedSampler(range(5), num_replicas=2)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    with phalanx.process_group(timeout=5):
        s = DistributedSampler(range(5))
        assert (s.num_replicas, s.rank, len(s)) == (1, 0, 5)


def test_empty_or_all_dropped_yields_nothing_as_torchs() -> None:
    assert list(DistributedSampler([], 2, 1)) == [] and len(DistributedSampler([], 2, 1)) == 0
    with pytest.warns(UserWarning, match=r"drops all 3 samples \(fewer than num_replicas=4\)"):
        s = DistributedSampler(range(3), 4, 3, drop_last=True)
    assert list(s) == [] and (len(s), s.total_size, s.padding) == (0, 0, 0)


def test_finished_epoch_loads_at_another_world_size() -> None:
    # An elastic restart: saved by 4 replicas at the end of epoch 2, resumed by 2 replicas.
    s = DistributedSampler(range(64), 4, 1, seed=5)
    s.set_epoch(2)
    s.advance(len(s))
    resumed = DistributedSampler(range(64), 2, 1)
    resumed.load_state_dict(s.state_dict())
    assert (resumed.epoch, resumed.seed, resumed.position) == (2, 5, len(resumed))
    resumed.set_epoch(3)  # the loop moves on to the next epoch, from its start
    assert resumed.position == 0 and len(list(resumed)) == 32
