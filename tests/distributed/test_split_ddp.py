"""A model split over two devices in each process, wrapped in phalanx's DDP (seed 002).

Each of 2 ranks drives a :class:`SplitModule` over two devices (``["cpu", "cpu"]`` here) and wraps
it in ``phalanx.DistributedDataParallel`` with ``device_ids=None``. The result must equal one
process training the unsplit model on the full batch (BatchNorm sees each rank's shard, and the
running statistics follow rank 0, as in ``ddp_cases.reference``).

Tolerance: replicas must be bit-identical to each other (same reduced bytes, same optimizer);
against the single-process reference they differ only by floating-point reassociation of the mean
(per-rank partial sums, gradients divided by the world size before the sum): rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.model_parallel import split_across_devices
from phalanx.testing import run_distributed
from tests.unit.test_split_devices import resnet_like

WORLD, STEPS, PER_RANK = 2, 3, 4
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny_buckets_as_views": {"bucket_cap_mb": 1e-3, "gradient_as_bucket_view": True},
}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 1, 8, 8, generator=g), torch.randint(
        0, 10, (PER_RANK,), generator=g
    )


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_split_ddp() -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    rank = phalanx.world().rank
    results = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(rank)  # different on purpose: wrapping broadcasts rank 0's model
        split = split_across_devices(resnet_like(), [torch.device("cpu")] * 2)
        ddp = phalanx.DistributedDataParallel(split, **config)
        opt = _optimizer(ddp.parameters())
        for step in range(STEPS):
            x, y = _batch(step, rank)
            opt.zero_grad()
            out = ddp(x)
            nn.functional.cross_entropy(out, y.to(split.output_device)).backward()
            opt.step()
        results[name] = {
            "params": [p.detach().clone() for p in split.parameters()],
            "buffers": [b.clone() for b in split.buffers()],
            "buckets": len(ddp.reducer.buckets),
            "balance": split.balance,
        }
    return results


def _reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, unsplit model, the full batch: shard losses averaged, buffers from rank 0."""
    torch.manual_seed(0)
    model = resnet_like()
    opt = _optimizer(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        start = [b.clone() for b in model.buffers()]
        for rank in reversed(range(WORLD)):  # rank 0 last: its running statistics are kept
            for b, saved in zip(model.buffers(), start):
                b.copy_(saved)
            x, y = _batch(step, rank)
            (nn.functional.cross_entropy(model(x), y) / WORLD).backward()
        opt.step()
    return [p.detach() for p in model.parameters()], list(model.buffers())


def test_split_model_under_ddp_matches_one_process_on_the_full_batch() -> None:
    results = run_distributed(_train_split_ddp, world_size=WORLD, timeout=120)
    want_params, want_buffers = _reference()
    for name in CONFIGS:
        mine, theirs = results[0][name], results[1][name]
        assert mine["balance"][0] >= 2 and mine["balance"][1] >= 2, mine["balance"]
        for i, (a, b) in enumerate(zip(mine["params"], theirs["params"])):
            assert torch.equal(a, b), f"{name}: parameter {i} differs between the ranks"
        got = [*mine["params"], *mine["buffers"]]
        assert len(got) == len(want_params) + len(want_buffers)
        for i, (g, w) in enumerate(zip(got, [*want_params, *want_buffers])):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name}: tensor {i}")
    assert results[0]["tiny_buckets_as_views"]["buckets"] > 4  # buckets on both sides of the cut
