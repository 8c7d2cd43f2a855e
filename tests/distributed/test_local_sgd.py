"""``phalanx.LocalSGD`` and ``phalanx.DiLoCo`` in a Job on 2 gloo ranks.

- Against a one-process simulation of both replicas (each its own optimizer on its own
  batches; every H steps the average, or DiLoCo's outer step with torch's SGD): bitwise equal,
  since the 2-rank average is ``(a + b) / 2`` in either order and every other operation is the
  same on the same inputs.
- The base cases: H = 1 LocalSGD and DiLoCo (outer lr 1, no momentum) against DDP, with
  plain SGD (see ``test_h1_equals_ddp`` for the tolerance).
- Bytes: what each rank hands to all-reduces is its parameters once per synchronisation,
  counted alike by ``SyncStats`` and ``phalanx.comm_stats()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import phalanx
from phalanx.testing import run_distributed
from phalanx.train.strategies.local_sgd import ReplicaRunner

STEPS = 7
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


Optim = Callable[[nn.Module], torch.optim.Optimizer]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-2)


def _train(strategy: phalanx.train.Strategy | str, make_opt: Optim) -> dict[str, Any]:
    """STEPS steps of ``strategy`` on this rank's batches: parameters, stats, bytes sent."""
    model = _model()
    opt = make_opt(model)
    job = phalanx.Job(strategy, straggler_check_every=0)
    model, opt = job.setup(model, opt, loss_fn=F.mse_loss)
    phalanx.reset_comm_stats()
    for step in range(STEPS):
        job.forward_backward(*_batch(job.world.rank, step))
        job.step()
    sent = sum(b for _, b in phalanx.comm_stats().values())
    runner = job.runner
    stats = runner.sync.stats if isinstance(runner, ReplicaRunner) and runner.sync else None
    out = {"params": [p.detach().clone() for p in model.parameters()], "sent": sent}
    out["stats"] = None if stats is None else (stats.syncs, stats.bytes_sent)
    job.close()
    return out


def _simulate(
    every: int, make_opt: Optim, outer: dict[str, float] | None
) -> list[list[torch.Tensor]]:
    """Both replicas in one process; ``outer`` None: LocalSGD, else DiLoCo's outer SGD."""
    replicas = [_model() for _ in range(2)]
    opts = [make_opt(m) for m in replicas]
    theta = [p.detach().clone() for p in replicas[0].parameters()]
    outer_opt = None
    if outer is not None:
        nesterov = outer["momentum"] > 0
        outer_opt = torch.optim.SGD(theta, outer["lr"], outer["momentum"], nesterov=nesterov)
    for step in range(STEPS):
        for rank, (m, o) in enumerate(zip(replicas, opts)):
            x, y = _batch(rank, step)
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


def _against_simulation() -> dict[str, Any]:
    out: dict[str, Any] = {}
    diloco = phalanx.DiLoCo(sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    local = phalanx.LocalSGD(sync_every=3)
    out["localsgd"] = _train(local, _adamw)
    out["diloco"] = _train(diloco, _adamw)
    if dist.get_rank() == 0:
        out["sim_localsgd"] = _simulate(3, _adamw, None)
        out["sim_diloco"] = _simulate(3, _adamw, {"lr": 0.7, "momentum": 0.9})
    return out


def test_localsgd_and_diloco_equal_a_one_process_simulation_bitwise() -> None:
    results = run_distributed(_against_simulation, world_size=2, timeout=60)
    sim = results[0]
    for name in ("localsgd", "diloco"):
        for rank, got in enumerate(results):
            # Each rank's replica after STEPS = 7 steps, H = 3 (the last sync at step 6).
            for i, (a, b) in enumerate(zip(got[name]["params"], sim[f"sim_{name}"][rank])):
                assert torch.equal(a, b), f"{name} rank {rank} parameter {i}"
        # After the sync at step 6 each rank took one step of its own: the replicas differ.
        assert not torch.equal(results[0][name]["params"][0], results[1][name]["params"][0])
        numel = sum(p.numel() for p in results[0][name]["params"])
        # Two synchronisations (steps 3 and 6), each the parameters once, in float32.
        assert results[0][name]["stats"] == (2, 2 * 4 * numel)
        assert results[0][name]["sent"] == 2 * 4 * numel, "comm_stats counts the same bytes"


def _h1() -> dict[str, Any]:
    return {
        "ddp": _train("ddp", _sgd),
        "localsgd": _train(phalanx.LocalSGD(sync_every=1), _sgd),
        "diloco": _train(phalanx.DiLoCo(sync_every=1, outer_lr=1.0, outer_momentum=0.0), _sgd),
    }


def test_h1_equals_ddp() -> None:
    """H = 1 with plain SGD is DDP's step, in a different order of float operations.

    DDP steps p − lr·(g₀ + g₁)/2; LocalSGD averages ((p − lr·g₀) + (p − lr·g₁))/2; DiLoCo
    steps p − 1·((p − p₀) + (p − p₁))/2. Each rounds differently, by an ulp or so of the
    parameters per step (|p| < 0.5 here: ulp <= 2⁻²⁵ ≈ 3e-8). The tolerance, atol 1e-6 (about
    33 such ulps over 7 steps), leaves room for that and nothing more: a wrong average or a
    missed step moves them by ~lr·|g| ≈ 1e-2. Measured: 1.2e-7 for both (4 ulps). Replicas
    are bitwise equal to each other.
    """
    results = run_distributed(_h1, world_size=2, timeout=60)
    for rank, got in enumerate(results):
        ref = got["ddp"]["params"]
        for name in ("localsgd", "diloco"):
            for i, (a, b) in enumerate(zip(got[name]["params"], ref)):
                diff = (a - b).abs().max().item()
                assert diff <= 1e-6, f"rank {rank} {name} parameter {i}: max |diff| {diff}"
                assert torch.equal(a, results[0][name]["params"][i]), "replicas differ"
    numel = sum(p.numel() for p in results[0]["ddp"]["params"])
    # Every step synchronises the parameters once: what DDP sends in gradients.
    assert results[0]["localsgd"]["stats"] == (STEPS, STEPS * 4 * numel)
    assert results[0]["ddp"]["sent"] == STEPS * 4 * numel
