"""The job API on real ranks: accumulation equals a larger batch and syncs once per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed

K = 3  # micro-steps per optimizer step
MICRO = 4  # samples per rank per micro-step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + micro)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 2, generator=g)


def _accumulate(strategy: str) -> tuple[list[torch.Tensor], int, int, list[bool]]:
    job = phalanx.Job(strategy=strategy, grad_accum=K)
    model, opt = job.setup(_model(), None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job.optimizer = opt
    stepped = []
    phalanx.reset_comm_stats()
    for micro in range(K):
        x, y = _batch(phalanx.world().rank, micro)
        job.backward(nn.functional.mse_loss(model(x), y))
        stepped.append(job.step())
    calls = phalanx.comm_stats().get("all_reduce", (0, 0))[0]
    buckets = len(model.reducer.buckets) if strategy == "ddp" else -1
    return [p.detach().clone() for p in model.parameters()], calls, buckets, stepped


def _reference(world: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = zip(*[_batch(r, m) for r in range(world) for m in range(K)])
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["ddp", "torch-ddp"])
def test_accumulation_equals_one_step_on_k_times_the_batch(strategy: str) -> None:
    results = run_distributed(_accumulate, strategy, world_size=2)
    ref = _reference(2)
    for params, calls, buckets, stepped in results:
        assert stepped == [False, False, True]
        for got, want in zip(params, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if strategy == "ddp":
            assert calls == buckets  # one round of bucket all-reduces, not K
