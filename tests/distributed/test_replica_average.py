"""``phalanx.mesh.average_gradients``: the mesh's replica average on the shared bucket engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.mesh import average_gradients
from phalanx.testing import run_distributed


def _average() -> dict[str, Any]:
    rank = dist.get_rank()
    params = [
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        nn.Parameter(torch.zeros(4)),
        nn.Parameter(torch.zeros(5)),  # no gradient: skipped
    ]
    for i, p in enumerate(params[:3]):
        p.grad = torch.full_like(p, float(rank + 1) * (i + 1))
    # 16-byte buckets, last parameter first: the 4 floats fill one, the 3 floats cannot join
    # it, the 2 doubles have a dtype of their own: 3 buckets
    world = dist.group.WORLD
    assert world is not None
    sent = average_gradients(params, world, bucket_bytes=16)
    return {
        "sent": sent,
        "grads": [p.grad.tolist() if p.grad is not None else None for p in params],
        "dtypes": [str(p.grad.dtype) for p in params[:3] if p.grad is not None],
    }


def test_average_gradients_buckets_by_kind_and_cap_and_averages_every_gradient() -> None:
    results = run_distributed(_average, world_size=2, timeout=60)
    assert results[0] == results[1]
    out = results[0]
    assert out["sent"] == 3
    assert out["grads"] == [[1.5] * 3, [3.0, 3.0], [4.5] * 4, None]
    assert out["dtypes"] == ["torch.float32", "torch.float64", "torch.float32"]


def test_average_gradients_rejects_a_bad_bucket_size() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        average_gradients([], None, bucket_bytes=0)  # type: ignore[arg-type]
