"""The job API's ZeRO strategies and torch baselines train the same model to the same losses."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.models.gpt import GPT, GPTConfig
from phalanx.testing import run_distributed

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "torch-zero1", "torch-fsdp"]


def _losses(strategies: list[str]) -> dict[str, list[float]]:
    rank = phalanx.world().rank
    out = {}
    for strategy in strategies:
        job = phalanx.Job(strategy=strategy, seed=0)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, n_embd=16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, sharded = job.setup(model, opt, sched)
        assert sharded is not None and job.scheduler.optimizer is sharded
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            data = torch.randint(30, (4, 9), generator=g)
            _, loss = model(data[:, :-1], data[:, 1:])
            job.backward(loss)
            avg = loss.detach().clone()
            phalanx.all_reduce(avg, phalanx.ReduceOp.AVG)
            losses.append(float(avg))
            job.step(sharded)
        out[strategy] = losses
        out[f"{strategy}/lr"] = [sharded.param_groups[0]["lr"]]
        job.close()
    return out


def test_every_zero_strategy_matches_ddp() -> None:
    results = run_distributed(_losses, STRATEGIES, world_size=2, timeout=120)
    for res in results:
        for strategy in STRATEGIES:
            assert res[strategy] == pytest.approx(res["ddp"], rel=1e-4), strategy
            assert res[f"{strategy}/lr"] == [pytest.approx(1e-2 / 8)]  # the scheduler stepped it


def test_zero_strategy_without_an_optimizer_is_refused() -> None:
    job = phalanx.Job(strategy="zero2")
    try:
        with pytest.raises(
            ValueError, match=r"strategy=Zero\(stage=2, .*\) rebuilds the optimizer"
        ):
            job.setup(torch.nn.Linear(2, 2))
    finally:
        job.close()
