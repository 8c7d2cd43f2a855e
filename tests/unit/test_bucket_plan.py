"""DDP's buckets are torch's: the same parameters in the same buckets, so the same collectives.

A bucket takes parameters (last registered first) until it holds at least its cap, as torch's
``_compute_bucket_assignment_by_size`` does; closing a bucket before the parameter that would
pass the cap made an extra small bucket before each large parameter, one more collective in the
exposed tail of backward (the MLP of ``phalanx bench ddp`` at 1 MB: 1.077x torch's step before;
1.005x and 1.072x in two runs after, ``benchmarks/results/ddp_gloo.txt``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from phalanx.data_parallel.buckets import ParamSpec, plan_buckets

MIB = 1024 * 1024


def _torch_plan(numels: list[int], caps: list[int]) -> list[list[int]]:
    tensors = [torch.empty(n) for n in reversed(numels)]  # torch's DDP passes them reversed
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, caps)
    last = len(numels) - 1
    return [[last - i for i in bucket] for bucket in buckets]


@pytest.mark.parametrize("seed", range(20))
def test_buckets_equal_torchs(seed: int) -> None:
    rng = random.Random(seed)
    numels = [rng.choice([10, 1024, 40_000, 300_000, 2 * MIB]) for _ in range(rng.randint(1, 30))]
    caps = [MIB, rng.choice([MIB, 4 * MIB, 25 * MIB])]
    specs = [ParamSpec(i, n, 4, "torch.float32", "cpu") for i, n in enumerate(numels)]
    ours = [list(plan.params) for plan in plan_buckets(specs, caps)]
    assert ours == _torch_plan(numels, caps), (numels, caps)


def test_the_benchmarks_mlp_gets_two_buckets_at_1_mb() -> None:
    numels = [1024 * 2048, 2048, 2048 * 1024, 1024, 1024 * 10, 10]  # its three Linear layers
    specs = [ParamSpec(i, n, 4, "torch.float32", "cpu") for i, n in enumerate(numels)]
    plans = plan_buckets(specs, [MIB, MIB])
    assert [list(p.params) for p in plans] == [[5, 4, 3, 2], [1, 0]]
