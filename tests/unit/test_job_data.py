"""The data side of ``phalanx.Job`` in one process: the exact-evaluation sampler, ``gather`` in
a world of one, and seeding only when asked."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import phalanx
from phalanx.data.eval import EvalSampler
from phalanx.train.job import DATA_SEED


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 12])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
@pytest.mark.parametrize("shuffle", [False, True])
def test_eval_blocks_cover_every_sample_once(n: int, replicas: int, shuffle: bool) -> None:
    data = list(range(n))
    blocks = [list(EvalSampler(data, replicas, r, shuffle=shuffle)) for r in range(replicas)]
    joined = [i for b in blocks for i in b]
    assert sorted(joined) == data
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert [len(EvalSampler(data, replicas, r)) for r in range(replicas)] == list(map(len, blocks))
    if not shuffle:
        assert joined == data, "contiguous blocks in replica order are the dataset's order"


def test_eval_shuffle_follows_seed_and_epoch() -> None:
    data = list(range(20))
    a, b = EvalSampler(data, 1, 0, shuffle=True), EvalSampler(data, 1, 0, shuffle=True)
    assert list(a) == list(b) != data
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(EvalSampler(data, 1, 0, shuffle=True, seed=5)) != list(a)


def test_eval_loader_is_not_the_jobs_sampler() -> None:
    with phalanx.Job("single") as job:
        train = job.loader(list(range(5)), 2)
        sampler = job.sampler
        evaluated = [int(i) for b in job.loader(list(range(5)), 2, eval=True) for i in b]
        assert evaluated == list(range(5)) and job.sampler is sampler
        assert sampler is not None and sampler.position == 0
        assert len(list(train)) == 3


def test_gather_in_a_world_of_one() -> None:
    with phalanx.Job("single") as job:
        t = torch.arange(6.0).reshape(3, 2)
        assert torch.equal(job.gather(t), t)  # type: ignore[arg-type]
        assert torch.equal(job.gather(torch.tensor(2)), torch.tensor([2]))  # type: ignore[arg-type]
        assert job.gather(3) == [3] and job.gather(0.5) == [0.5] and job.gather(True) == [True]
        assert job.gather(np.float64(1.5)) == [1.5]
        with pytest.raises(TypeError, match=r"Job.gather\(value='x'\).*str 'x'"):
            job.gather("x")  # type: ignore[arg-type]


def _draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_default_seed_touches_no_generator() -> None:
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    expected = _draws()
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    with phalanx.Job("single") as job:
        assert job.seed is None and job.data_seed == DATA_SEED
        assert torch.initial_seed() == 1234
        assert _draws() == expected
        job.loader(list(range(4)), 2)
        assert job.sampler is not None and job.sampler.seed == DATA_SEED


def test_an_explicit_seed_seeds_every_generator_and_the_sampler() -> None:
    torch.manual_seed(1234)
    with phalanx.Job("single", seed=3) as job:
        assert torch.initial_seed() == 3
        got = _draws()
        job.loader(list(range(4)), 2)
        assert job.sampler is not None and job.sampler.seed == 3
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    assert got == _draws()
