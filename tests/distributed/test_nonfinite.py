"""``Job(skip_nonfinite=True)``: a step whose gradients hold a NaN on one rank is skipped on
every rank, under every lockstep strategy (ZeRO's shards and a pipeline's stages included);
without the guard the NaN reaches every parameter."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed

BAD_STEP, STEPS = 2, 4


def _train(strategy: str, guard: bool) -> dict[str, Any]:
    rank = phalanx.world().rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    job = phalanx.Job(strategy, skip_nonfinite=guard, seed=0)
    model, _opt = job.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stepped, after = [], []
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("phalanx.train.nonfinite").addHandler(handler)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        if step == BAD_STEP and rank == 1:
            loss = loss * float("nan")
        job.backward(loss)
        stepped.append(job.step())
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    job.close()
    finite = all(bool(torch.isfinite(v).all()) for v in after[-1].values())
    unchanged = all(torch.equal(after[0][k], after[1][k]) for k in after[0])
    return {"stepped": stepped, "finite": finite, "unchanged": unchanged, "said": records}


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(strategy: str) -> None:
    results = run_distributed(_train, strategy, True, world_size=2)
    for rank, got in enumerate(results):
        assert got["stepped"] == [True, False, True, True], rank
        assert got["finite"] and got["unchanged"], rank
    # The reduction spreads rank 1's NaN to every rank's (averaged or sharded) gradients.
    assert any(
        f"step {BAD_STEP} skipped: non-finite gradients (inf or NaN) on rank(s) 0, 1" in line
        for line in results[0]["said"]
    ), results[0]["said"]
    assert not results[1]["said"]  # rank 0 says it


def test_without_the_guard_the_nan_reaches_every_parameter() -> None:
    for got in run_distributed(_train, "ddp", False, world_size=2):
        assert got["stepped"] == [True] * STEPS and not got["finite"]


def _refused(strategy: object, precision: str) -> str:
    try:
        phalanx.Job(strategy, precision=precision, skip_nonfinite=True)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.parametrize(
    ("strategy", "precision", "said"),
    [
        ("ddp", "fp16-mixed", "fp16's loss scaler already skips"),
        ("ps-sync", "fp32", "the ranks of 'ps' do not step together"),
    ],
)
def test_where_it_cannot_work_it_is_refused_with_the_reason(
    strategy: str, precision: str, said: str
) -> None:
    for message in run_distributed(_refused, strategy, precision, world_size=2):
        assert message.startswith("Job(skip_nonfinite=True): ") and said in message, message
