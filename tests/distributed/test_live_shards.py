"""The live job's exact reduction and DDP's regroup, on real process groups.

``exact_average`` must give the same bits whatever the membership that computed the shards
(that is what makes ``recovery="live-exact"`` bit-identical to a fault-free run), and a DDP
rebound to a new default group with ``regroup()`` must reduce over it once per gradient.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from phalanx.data_parallel import DistributedDataParallel
from phalanx.testing import run_distributed
from phalanx.train.live_shards import exact_average, owned_shards

SHARDS, SIZE = 4, 1000


def _shard_grad(shard: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + shard)
    return torch.randn(SIZE, generator=g) * 10 ** (shard - 2)  # magnitudes that reassociate


def _average() -> list[float]:
    rank, size = dist.get_rank(), dist.get_world_size()
    slots = [_shard_grad(v) for v in owned_shards(SHARDS, size, rank)]
    return exact_average(slots, SHARDS, size).tolist()


def test_exact_average_is_the_same_bits_at_every_membership() -> None:
    expected = _shard_grad(0).clone()
    for v in range(1, SHARDS):
        expected.add_(_shard_grad(v))
    expected.div_(SHARDS)
    for world_size in (4, 3, 2):
        results = run_distributed(_average, world_size=world_size, timeout=60)
        for got in results:
            assert torch.equal(torch.tensor(got), expected), world_size
    # the order matters: another association differs, or the test above proves nothing
    other = (_shard_grad(3) + _shard_grad(2) + _shard_grad(1) + _shard_grad(0)) / SHARDS
    assert not torch.equal(other, expected)


def _regroup(folder: str) -> list[list[float]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 2))
    grads = []
    for generation in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.full((1, 3), float(rank + 1))).sum().backward()
        grads.append(model.module.weight.grad.flatten().tolist())
        if generation == 0:  # a new default group, as live recovery builds for a generation
            dist.destroy_process_group()
            store = dist.FileStore(str(Path(folder) / "g1"), 2)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20)
            )
            model.regroup()
    return grads


def test_ddp_regroup_reduces_over_the_new_group_once() -> None:
    folder = tempfile.mkdtemp(prefix="phalanx-regroup-")
    results = run_distributed(_regroup, folder, world_size=2, timeout=60)
    # inputs 1 and 2: the averaged weight gradient is 1.5 everywhere, in both generations
    for grads in results:
        assert grads == [[1.5] * 6, [1.5] * 6], grads
