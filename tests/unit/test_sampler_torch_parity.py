"""phalanx.DistributedSampler yields exactly torch's indices, and raises torch's exception types.

A property test: 500 seeded random argument combinations (dataset length 0..300, replicas
1..9, every rank, shuffle, seed, drop_last, epoch) plus every edge case (empty dataset, fewer
samples than replicas, lengths around multiples of the replica count), each compared index by
index with ``torch.utils.data.distributed.DistributedSampler``, and the invalid ranks and
replica counts compared by exception type.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from phalanx.data import DistributedSampler

pytestmark = pytest.mark.filterwarnings("ignore:DistributedSampler. drop_last=True drops all")


def _same(
    n: int, replicas: int, rank: int, shuffle: bool, seed: int, drop_last: bool, epoch: int
) -> None:
    ours = DistributedSampler(range(n), replicas, rank, shuffle, seed, drop_last)
    theirs = TorchSampler(range(n), replicas, rank, shuffle, seed, drop_last)  # type: ignore[arg-type]
    ours.set_epoch(epoch)
    theirs.set_epoch(epoch)
    case = (n, replicas, rank, shuffle, seed, drop_last, epoch)
    assert list(ours) == list(theirs), case
    assert len(ours) == len(theirs), case
    assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size), case


def _random_cases(count: int) -> list[tuple[Any, ...]]:
    rng = random.Random(13)
    cases = []
    for _ in range(count):
        replicas = rng.randint(1, 9)
        n = rng.choice([rng.randint(0, 2 * replicas), rng.randint(0, 300)])
        cases.append(
            (
                n,
                replicas,
                rng.randrange(replicas),
                rng.random() < 0.5,
                rng.randrange(2**31),
                rng.random() < 0.5,
                rng.randint(0, 50),
            )
        )
    return cases


def test_500_random_argument_combinations_yield_torchs_indices() -> None:
    cases = _random_cases(500)
    assert len(set(cases)) == 500
    for case in cases:
        _same(*case)


def test_every_edge_case_yields_torchs_indices() -> None:
    for replicas in (1, 2, 3, 4, 7):
        lengths = {0, 1, replicas - 1, replicas, replicas + 1, 2 * replicas - 1, 2 * replicas + 1}
        for n, rank, shuffle, drop_last, epoch in itertools.product(
            sorted(x for x in lengths if x >= 0),
            range(replicas),
            (True, False),
            (True, False),
            (0, 3),
        ):
            _same(n, replicas, rank, shuffle, 5, drop_last, epoch)


def _error(cls: type, **kw: Any) -> type[BaseException] | None:
    try:
        list(cls(range(5), **kw))  # torch checks some arguments only when iterating
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc)
    return None


@pytest.mark.parametrize(
    "kw",
    [
        {"num_replicas": 0, "rank": 0},
        {"num_replicas": -1, "rank": 0},
        {"num_replicas": -3, "rank": -1},
        {"num_replicas": 2, "rank": -1},
        {"num_replicas": 2, "rank": 2},
        {"num_replicas": 2, "rank": 7},
        {"num_replicas": 2.0, "rank": 0},
        {"num_replicas": 2, "rank": 1.0},
        {},  # no process group: torch's raises, never the whole dataset on every process
        {"num_replicas": 2},
        {"rank": 0},
    ],
)
def test_invalid_rank_or_replicas_raise_torchs_exception_type(kw: dict[str, Any]) -> None:
    want = _error(TorchSampler, **kw)
    assert want is not None
    assert _error(DistributedSampler, **kw) is want
