"""One gradient bucket of the reducer: its flat buffer, views, readiness and communication.

A dense bucket owns a flat buffer with one view per parameter, shaped like it. A sparse bucket
holds one parameter whose gradient is a sparse tensor; its buffer is that gradient, taken when
it is ready (a sparse all-reduce cannot share a flat buffer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.comm.shm import gives_shared_buffers, shared_buffer
from phalanx.comm.shm.ops import DTYPES
from phalanx.data_parallel.buckets import BucketPlan
from phalanx.data_parallel.grad_bucket import GradBucket

__all__ = ["Bucket", "WaitFuture", "bucket_storage"]


def bucket_storage(
    group: dist.ProcessGroup | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A bucket's zero-filled flat buffer: in the group's shared memory where its backend gives
    that (backend 'shm', CPU), so its all-reduce copies nothing; else ``torch.zeros``."""
    shared = device.type == "cpu" and numel > 0 and dtype in DTYPES
    if shared and gives_shared_buffers(group):
        return shared_buffer(group, numel, dtype)
    return torch.zeros(numel, dtype=dtype, device=device)


class Bucket:
    """The state of one bucket across one iteration."""

    def __init__(
        self,
        index: int,
        plan: BucketPlan,
        params: list[nn.Parameter],
        extra: int,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.index = index
        self.plan = plan
        self.params = params
        self.sparse = plan.sparse
        device = params[0].device
        self.buffer = bucket_storage(group, 0 if self.sparse else plan.numel + extra, dtype, device)
        self.views = (
            []
            if self.sparse
            else [self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(plan.offsets, params)]
        )
        self.reset()

    def reset(self) -> None:
        """Forget the last iteration: nothing divided, nothing deferred, nothing skipped."""
        self.divided = [False] * len(self.params)
        self.deferred: list[tuple[int, torch.Tensor]] = []
        """Gradients waiting for one batched copy (``batched_grad_copy``)."""
        self.skipped = False
        """Not reduced this iteration: every parameter in it is unused on every rank."""

    def stage(self, k: int, grad: torch.Tensor | None, divisor: int | None) -> None:
        """Put parameter ``k``'s gradient in the bucket, divided by ``divisor`` if given.

        ``divisor=None`` (a communication hook is registered) stages the local gradient. A
        gradient that already is the bucket view (``gradient_as_bucket_view``) is left in place
        and divided at launch.
        """
        if self.sparse:
            self.buffer = _sparse_copy(grad, self.params[k], divisor)
            self.divided[k] = True
            return
        view = self.views[k]
        if grad is None:
            view.zero_()
            self.divided[k] = True
        elif grad.data_ptr() != view.data_ptr():
            if divisor is None:
                view.copy_(grad)
            else:  # fold the 1/N of the average into the copy: one pass over the gradient
                torch.div(grad, divisor, out=view)
                self.divided[k] = True

    def defer(self, k: int, grad: torch.Tensor | None) -> None:
        """Keep parameter ``k``'s gradient for :meth:`flush` (``batched_grad_copy``)."""
        if grad is None:
            self.views[k].zero_()
            self.divided[k] = True
        elif grad.data_ptr() != self.views[k].data_ptr():
            self.deferred.append((k, grad))

    def flush(self) -> None:
        """Copy the deferred gradients in one ``_foreach_copy_``; one flat division follows at
        launch (torch's ``batched_grad_copy``: 2 kernels per bucket instead of 2 per parameter)."""
        if self.deferred:
            torch._foreach_copy_(
                [self.views[k] for k, _ in self.deferred], [g for _, g in self.deferred]
            )
            self.deferred = []

    def divide_rest(self, divisor: int) -> None:
        """Divide the gradients that were accumulated in place in their views."""
        if not any(self.divided):
            self.buffer.div_(divisor)
            return
        for view, done in zip(self.views, self.divided):
            if not done:
                view.div_(divisor)

    def check_layout(self, grad: torch.Tensor, name: str) -> None:
        """A sparse gradient needs a sparse bucket and a dense one a dense bucket."""
        if grad.is_sparse != self.sparse:
            raise RuntimeError(
                f"[rank {dist.get_rank()}] DistributedDataParallel: parameter {name!r} produced a "
                f"{'sparse' if grad.is_sparse else 'dense'} gradient but was planned "
                f"{'sparse' if self.sparse else 'dense'}: gradients are sparse exactly for "
                f"nn.Embedding / nn.EmbeddingBag with sparse=True"
            )

    def all_reduce(self, group: dist.ProcessGroup | None, divisor: int) -> WaitFuture:
        """Launch the averaging all-reduce of the bucket (the division happens first)."""
        if not self.sparse:
            self.divide_rest(divisor)
        work = c.all_reduce(self.buffer, dist.ReduceOp.SUM, group, async_op=True)
        return WaitFuture(work, self.buffer)

    def run_hook(self, hook: Any, state: Any, is_last: bool) -> Any:
        """Hand the bucket, with local gradients, to a communication hook; its future."""
        gradients = [self.buffer] if self.sparse else list(self.views)
        bucket = GradBucket(self.index, self.buffer, gradients, list(self.params), is_last)
        future = hook(state, bucket)
        if not hasattr(future, "wait"):
            raise RuntimeError(
                f"Communication hook: callback must return a torch.futures.Future object, but "
                f"got {type(future).__name__} for bucket {self.index}"
            )
        return future

    def absorb(self, result: Any) -> None:
        """Take a communication's result as the bucket's reduced gradients."""
        if result is self.buffer:
            return
        if not isinstance(result, torch.Tensor) or result.shape != self.buffer.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise ValueError(
                f"communication hook returned {got} for bucket {self.index}, expected a tensor "
                f"of shape {tuple(self.buffer.shape)} (the bucket's flat buffer, averaged)"
            )
        if self.sparse:
            self.buffer = result
        else:
            self.buffer.copy_(result)

    def value(self, k: int) -> torch.Tensor:
        """The reduced gradient of parameter ``k``."""
        return self.buffer if self.sparse else self.views[k]


def _sparse_copy(
    grad: torch.Tensor | None, param: nn.Parameter, divisor: int | None
) -> torch.Tensor:
    if grad is None:  # no rows, shaped like an embedding's gradient (one sparse dimension)
        return torch.sparse_coo_tensor(
            torch.zeros((1, 0), dtype=torch.int64, device=param.device),
            torch.zeros((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
            param.shape,
        )
    grad = grad.coalesce()
    return grad / divisor if divisor is not None else grad.clone()


class WaitFuture:
    """Minimal future over a tracked work: ``wait()`` reports failures with phalanx's errors."""

    def __init__(self, work: Any, value: torch.Tensor) -> None:
        self._work, self._value = work, value

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._value

    def value(self) -> torch.Tensor:
        return self._value
