"""ZeRO-1 parity with one process on the full batch, and optimizer state of 1/N."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.testing import run_distributed

STEPS, PER_RANK = 5, 6


def _model() -> nn.Module:
    torch.manual_seed(0)  # 10*7+7 + 7*3+3 = 101 parameters: not divisible by 2 or 3
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 10, generator=g), torch.randn(PER_RANK, 3, generator=g)


OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _train(name: str) -> tuple[list[torch.Tensor], int, int]:
    cls, kw = OPTS[name]
    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step, phalanx.world().rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    total = sum(p.numel() for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()], opt.state_bytes(), total


def _reference(name: str, world: int) -> list[torch.Tensor]:
    cls, kw = OPTS[name]
    model = _model()
    opt = cls(model.parameters(), **kw)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*[_batch(step, r) for r in range(world)])
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_zero1_matches_one_process_and_shards_state(name: str, world_size: int) -> None:
    results = run_distributed(_train, name, world_size=world_size)
    ref = _reference(name, world_size)
    for params, state_bytes, total in results:
        for got, want, other in zip(params, ref, results[0][0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert torch.equal(got, other)  # replicas bit-identical
        per_element = 8 if name == "adamw" else 4  # exp_avg + exp_avg_sq, or momentum
        assert state_bytes <= 1.02 * per_element * -(-total // world_size)
