"""ZeRO-1/2 keep the model's buffers rank 0's by DDP's rule: at start-up (ranks that built
their buffers from different seeds end up with rank 0's), then before a forward whenever the
one before it trained and synchronised (with gradient accumulation, the first micro-step of a
window; an evaluation forward in between included): batch-norm statistics equal DDP's.
``phalanx verify --mode strategy --strategy zero2 --against ddp`` found them rank-local."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed


def _train(strategy: str, accum: int) -> dict[str, Any]:
    rank = phalanx.world().rank
    torch.manual_seed(rank)  # different parameters and buffers on each rank
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    net.register_buffer("projection", torch.randn(4, 4))
    job = phalanx.Job(strategy, grad_accum=accum)
    model, _opt = job.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    at_start = net.projection.clone()
    for step in range(4):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        job.backward(model(x @ net.projection).square().mean())
        job.step()
        if step == 1:
            with torch.no_grad():  # an evaluation forward between steps, as DDP sees one
                model(x @ net.projection)
    state = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    job.close()
    return {"start": at_start, "running": state}


@pytest.mark.parametrize(("strategy", "accum"), [("zero1", 1), ("zero2", 1), ("zero2", 2)])
def test_buffers_are_rank_0s_at_start_and_synced_by_ddps_rule(strategy: str, accum: int) -> None:
    ddp = run_distributed(_train, "ddp", accum, world_size=2)
    zero = run_distributed(_train, strategy, accum, world_size=2)
    for rank in (0, 1):
        assert torch.equal(zero[rank]["start"], ddp[0]["start"])  # rank 0's
        running = zero[rank]["running"]
        assert running.keys() == ddp[rank]["running"].keys() and running
        for name, value in running.items():
            assert torch.equal(value, ddp[rank]["running"][name]), (rank, name)
