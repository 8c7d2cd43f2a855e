"""Average gradients over a data-parallel group after a step that DDP's hooks cannot follow.

A pipeline stage runs ``m`` forwards and ``m`` backwards per optimizer step, interleaved with
other micro-batches, so DDP's "all-reduce during the one backward" does not apply. The stage's
accumulated gradients are averaged once the schedule has run: packed into flat buckets of at
most ``bucket_bytes`` (one dtype and device each), all buckets launched before the first wait,
then unpacked.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from phalanx.comm import collectives as C

__all__ = ["average_gradients"]


def _buckets(grads: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for g in grads:
        runs = by_kind.setdefault((g.dtype, g.device), [[]])
        size = sum(t.numel() * t.element_size() for t in runs[-1])
        if runs[-1] and size + g.numel() * g.element_size() > cap:
            runs.append([])
        runs[-1].append(g)
    return [run for runs in by_kind.values() for run in runs if run]


def average_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    bucket_bytes: int = 25 * 1024 * 1024,
) -> int:
    """Replace each parameter's ``.grad`` by its mean over ``group``; returns buckets sent.

    Parameters without a gradient are skipped, so every rank of ``group`` must hold gradients
    for the same parameters (replicas of one model shard do).
    """
    if bucket_bytes < 1:
        raise ValueError(f"average_gradients: bucket_bytes must be >= 1, got {bucket_bytes}")
    if dist.get_world_size(group) == 1:
        return 0
    grads = [p.grad for p in params if p.grad is not None]
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        work = C.all_reduce(flat, C.ReduceOp.AVG, group=group, async_op=True)
        pending.append((bucket, flat, work))
    for bucket, flat, work in pending:
        work.wait()
        for g, avg in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(avg)
    return len(pending)
