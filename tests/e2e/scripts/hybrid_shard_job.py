"""A ZeRO-3 job for the multi-host tier (``tests/multihost/test_hybrid_shard.py``).

``python hybrid_shard_job.py OUT CKPT SHARD`` under ``phalanx run``: a small MLP trained with
``phalanx.Zero(stage=3, shard=SHARD)`` for STEPS steps of a fixed global batch split evenly over
the ranks (so the result does not depend on the layout), then a checkpoint in CKPT. Every rank
prints its groups; rank 0 writes the model's full state to ``OUT/train-<world size>.pt``.
:func:`reference` trains the same model in one process (the test imports this file for it).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.train.strategies.zero import ZeroRunner

STEPS, GLOBAL_BATCH = 3, 8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # type: ignore[arg-type]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def reference() -> dict[str, torch.Tensor]:
    """The parameters after STEPS steps in one process on the whole batch."""
    net = model()
    opt = optimizer(net.parameters())
    for step in range(STEPS):
        x, y = batch(step, 0, 1)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def main(out: str, ckpt: str, shard: str) -> None:
    torch.set_num_threads(1)
    job = phalanx.Job(phalanx.Zero(stage=3, shard=shard), checkpoint_dir=ckpt, seed=0)
    net = model()
    wrapped, opt = job.setup(net, optimizer(net.parameters()))
    world = job.world
    if isinstance(job.runner, ZeroRunner):
        groups = job.runner.hybrid
        shard_ranks = dist.get_process_group_ranks(groups.shard)
        print(f"node {world.node_rank}: {groups.describe()}; shard ranks {shard_ranks}")
    while job.step_count < STEPS:
        x, y = batch(job.step_count, world.rank, world.world_size)
        job.backward(nn.functional.mse_loss(wrapped(x), y))
        job.step(opt)
    job.save(async_=False)
    state = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    if world.rank == 0:
        torch.save(state, f"{out}/train-{world.world_size}.pt")
    job.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
