"""``Job()`` seeds nothing, and the strategies still start every rank from equal parameters:
each rank here builds its model from another seed, as an unseeded program would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed


def _start(strategy: str) -> tuple[dict[str, torch.Tensor], int]:
    job = phalanx.Job(strategy)
    torch.manual_seed(100 + job.world.rank)  # a different build on every rank
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, _ = job.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seed = torch.initial_seed()
    job.close()
    return state, seed


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_replicas_start_equal_without_a_seed(strategy: str) -> None:
    (a, seed_a), (b, seed_b) = run_distributed(_start, strategy, world_size=2)
    assert (seed_a, seed_b) == (100, 101), "Job() left the generators alone"
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
