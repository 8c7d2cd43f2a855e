"""What the LocalSGD / DiLoCo / streaming DiLoCo tests train, and one-process simulations.

The simulations run both replicas of a 2-rank job in one process from the papers' update rules
(torch's SGD as the outer optimizer; the separately tested codec for quantised averages); the
tests compare the Job's parameters with them bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import phalanx
from phalanx.local_sgd.fragments import due, split_fragments
from phalanx.local_sgd.quantise import decode, encode
from phalanx.train.strategies.local_sgd import ReplicaRunner

STEPS = 7
LR = 0.1
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}
"""DiLoCo's outer optimizer in these tests (the paper's)."""
BLOCK = 16
"""Elements per quantisation scale (small, so the test model has several blocks)."""

__all__ = [
    "BLOCK",
    "OUTER",
    "STEPS",
    "adamw",
    "batch",
    "make_model",
    "sgd",
    "simulate",
    "simulate_streaming",
    "train",
]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


Optim = Callable[[nn.Module], torch.optim.Optimizer]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-2)


def train(
    strategy: phalanx.train.Strategy | str, make_opt: Optim, flush: bool = False
) -> dict[str, Any]:
    """STEPS steps of ``strategy`` on this rank's batches (then, with ``flush``, a
    synchronisation off the schedule): parameters, stats, bytes sent."""
    model = make_model()
    opt = make_opt(model)
    job = phalanx.Job(strategy, straggler_check_every=0)
    model, opt = job.setup(model, opt, loss_fn=F.mse_loss)
    phalanx.reset_comm_stats()
    for step in range(STEPS):
        job.forward_backward(*batch(job.world.rank, step))
        job.step()
    runner = job.runner
    sync = runner.sync if isinstance(runner, ReplicaRunner) else None
    if flush and sync is not None:
        sync.flush()
    sent = sum(b for _, b in phalanx.comm_stats().values())
    stats = None if sync is None else sync.stats
    out = {"params": [p.detach().clone() for p in model.parameters()], "sent": sent}
    out["stats"] = None if stats is None else (stats.syncs, stats.bytes_sent)
    job.close()
    return out


def simulate(
    every: int, make_opt: Optim, outer: dict[str, float] | None
) -> list[list[torch.Tensor]]:
    """Both replicas in one process; ``outer`` None: LocalSGD, else DiLoCo's outer SGD."""
    replicas = [make_model() for _ in range(2)]
    opts = [make_opt(m) for m in replicas]
    theta = [p.detach().clone() for p in replicas[0].parameters()]
    outer_opt = None
    if outer is not None:
        nesterov = outer["momentum"] > 0
        outer_opt = torch.optim.SGD(theta, outer["lr"], outer["momentum"], nesterov=nesterov)
    for step in range(STEPS):
        for rank, (m, o) in enumerate(zip(replicas, opts)):
            x, y = batch(rank, step)
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        if (step + 1) % every:
            continue
        with torch.no_grad():
            locals_ = [list(m.parameters()) for m in replicas]
            if outer_opt is None:
                for a, b in zip(*locals_):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
                continue
            for i, t in enumerate(theta):
                t.grad = ((t - locals_[0][i]) + (t - locals_[1][i])) / 2
            outer_opt.step()
            for i, t in enumerate(theta):
                locals_[0][i].copy_(t)
                locals_[1][i].copy_(t)
    return [[p.detach().clone() for p in m.parameters()] for m in replicas]


def simulate_streaming(
    every: int, fragments: int, offsets: list[int], overlap: int, codec: str
) -> Any:
    replicas = [make_model() for _ in range(2)]
    opts = [adamw(m) for m in replicas]
    theta = [p.detach().clone() for p in replicas[0].parameters()]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    plan = split_fragments([t.numel() for t in theta], fragments)
    flights: dict[int, tuple[int, list[torch.Tensor]]] = {}
    local = [[p.detach() for p in m.parameters()] for m in replicas]
    for step in range(1, STEPS + 1):
        for rank, (m, o) in enumerate(zip(replicas, opts)):
            F.mse_loss(m(batch(rank, step - 1)[0]), batch(rank, step - 1)[1]).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in sorted(q for q, (at, _) in flights.items() if at == step):
                _outer_step(theta, outer, plan[p], flights.pop(p)[1], local)
            for p, offset in enumerate(offsets):
                if due(step, every, offset):
                    flights[p] = (step + overlap, _mean_delta(theta, local, plan[p], codec))
                    if overlap == 0:
                        _outer_step(theta, outer, plan[p], flights.pop(p)[1], local)
    return [[t.clone() for t in rank] for rank in local]


def _mean_delta(
    theta: list[torch.Tensor], local: list[list[torch.Tensor]], idx: list[int], codec: str
) -> list[torch.Tensor]:
    per_rank = [torch.cat([(theta[i] - r[i]).reshape(-1) for i in idx]) for r in local]
    n = per_rank[0].numel()
    total = torch.zeros(n)
    for d in per_rank:  # rank order, as every rank decodes
        total += decode(encode(d, codec, BLOCK), codec, n, BLOCK)
    mean = total / 2
    return [
        piece.view_as(theta[i])
        for piece, i in zip(mean.split([theta[i].numel() for i in idx]), idx)
    ]


def _outer_step(
    theta: list[torch.Tensor],
    outer: torch.optim.Optimizer,
    idx: list[int],
    mean: list[torch.Tensor],
    local: list[list[torch.Tensor]],
) -> None:
    for i, d in zip(idx, mean):
        theta[i].grad = d
    outer.step()
    for i in idx:
        theta[i].grad = None
        for r in local:
            r[i].copy_(theta[i])
