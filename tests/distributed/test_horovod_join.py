"""hvd.join() with uneven inputs: the joined rank shadows the others' gradient all-reduces."""

from __future__ import annotations

import time

import torch
from torch import nn

import phalanx.horovod as hvd
from phalanx.testing import run_distributed


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))


def _reference(world: int, steps: list[int]) -> list[torch.Tensor]:
    """One process: each step averages the gradients of the ranks that still have data."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(steps)):
        opt.zero_grad()
        for rank in range(world):
            if step < steps[rank]:
                x, y = _data(rank, step)
                (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _uneven(steps: list[int]) -> tuple[int, list[torch.Tensor], float]:
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    start = time.monotonic()
    for step in range(steps[hvd.rank()]):
        opt.zero_grad()
        x, y = _data(hvd.rank(), step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return last, [p.detach().clone() for p in model.parameters()], time.monotonic() - start


def test_join_shadows_uneven_ranks_and_matches_a_reference() -> None:
    steps = [3, 5, 4]
    results = run_distributed(_uneven, steps, world_size=3, timeout=90)
    assert {r[0] for r in results} == {1}  # every rank names the same last joiner
    ref = _reference(3, steps)
    for got, want in zip(results[1][1], ref):  # the rank that trained to the end
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert max(r[2] for r in results) < 30
