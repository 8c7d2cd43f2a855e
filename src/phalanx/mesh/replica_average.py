"""Average gradients over a data-parallel group after a step that DDP's hooks cannot follow.

A pipeline stage runs ``m`` forwards and ``m`` backwards per optimizer step, interleaved with
other micro-batches, so DDP's "all-reduce during the one backward" does not apply. The stage's
accumulated gradients are averaged once the schedule has run, on the same bucket planner and
engine as DDP's (:mod:`phalanx.data_parallel.buckets`, :mod:`~phalanx.data_parallel.bucket_engine`):
flat buckets of at most ``bucket_bytes`` (one dtype and device each), every bucket launched
before the first wait, then copied back. :func:`average_tensors` is the same average over any
tensors (LocalSGD and DiLoCo average parameters and pseudo-gradients with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives as C
from phalanx.data_parallel.bucket_engine import BucketEngine
from phalanx.data_parallel.buckets import BucketPlan, ParamSpec, plan_buckets
from phalanx.data_parallel.coalesce import copy_back, flatten

__all__ = ["average_gradients", "average_tensors"]


class _Average:
    """The engine's collective: one averaging all-reduce per flat bucket."""

    def __init__(
        self, grads: list[torch.Tensor], plans: list[BucketPlan], group: dist.ProcessGroup | None
    ) -> None:
        self.grads, self.plans, self.group = grads, plans, group
        self.flats: dict[int, torch.Tensor] = {}

    def launch(self, bucket: int) -> dist.Work:
        flat = self.flats[bucket] = flatten([self.grads[i] for i in self.plans[bucket].params])
        return C.all_reduce(flat, C.ReduceOp.AVG, group=self.group, async_op=True)

    def complete(self, bucket: int, work: dist.Work) -> None:
        work.wait()
        copy_back(self.flats.pop(bucket), [self.grads[i] for i in self.plans[bucket].params])


def average_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    bucket_bytes: int = 25 * 1024 * 1024,
) -> int:
    """Replace each parameter's ``.grad`` by its mean over ``group``; returns buckets sent.

    Parameters without a gradient are skipped, so every rank of ``group`` must hold gradients
    for the same parameters (replicas of one model shard do).
    """
    return average_tensors([p.grad for p in params if p.grad is not None], group, bucket_bytes)


def average_tensors(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    bucket_bytes: int = 25 * 1024 * 1024,
) -> int:
    """Replace each of ``tensors`` (floating point) by its mean over ``group``, in flat buckets
    of at most ``bucket_bytes`` (one dtype and device each); returns buckets sent.

    Every rank of ``group`` must pass tensors of the same shapes and dtypes in the same order
    (the gradients of one model's replicas, LocalSGD's parameters).
    """
    if bucket_bytes < 1:
        raise ValueError(f"average_tensors: bucket_bytes must be >= 1, got {bucket_bytes}")
    if dist.get_world_size(group) == 1 or not tensors:
        return 0
    listed = list(tensors)
    specs = [
        ParamSpec(i, t.numel(), t.element_size(), str(t.dtype), str(t.device))
        for i, t in enumerate(listed)
    ]
    plans = plan_buckets(specs, (bucket_bytes,))
    engine = BucketEngine([0] * len(plans), _Average(listed, plans, group))
    engine.launch_all()  # every tensor is complete: all buckets go out before the first wait
    engine.wait_all()
    return len(plans)
