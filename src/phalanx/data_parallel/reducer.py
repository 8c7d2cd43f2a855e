"""The bucketed gradient all-reduce engine shared by DistributedDataParallel and Horovod.

During backward, a post-accumulate-grad hook per parameter copies its gradient into its flat
bucket (or finds it already there when gradients are bucket views). A bucket whose gradients are
all in launches its asynchronous all-reduce at once, **in bucket order** (every rank must issue
collectives in the same order), so communication overlaps the rest of backward. A callback queued
on the autograd engine waits for every bucket once backward ends — the one wait site — before the
optimizer can see a gradient.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.data_parallel.buckets import BucketPlan, ParamSpec, plan_buckets
from phalanx.data_parallel.grad_bucket import GradBucket

__all__ = ["Reducer", "UnusedParameterError"]

Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


class UnusedParameterError(RuntimeError):
    """Some parameters received no gradient while ``find_unused_parameters=False``."""


class _Bucket:
    def __init__(
        self, index: int, plan: BucketPlan, params: list[nn.Parameter], extra: int = 0
    ) -> None:
        self.index = index
        self.params = params
        device, dtype = params[0].device, params[0].dtype
        self.buffer = torch.zeros(plan.numel + extra, dtype=dtype, device=device)
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(plan.offsets, params)
        ]
        self.pending = len(params)
        self.divided = [False] * len(params)
        self.future: torch.futures.Future[torch.Tensor] | None = None


class Reducer:
    """Owns the buckets, the hooks and the per-iteration state of gradient synchronisation."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | None,
        bucket_cap_bytes: int,
        find_unused: bool,
        grad_as_bucket_view: bool,
        first_bucket_bytes: int | None = None,
        join_flag: bool = False,
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.find_unused = find_unused
        self.grad_as_view = grad_as_bucket_view
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        specs = [
            ParamSpec(i, p.numel(), p.element_size(), str(p.dtype), str(p.device))
            for i, p in enumerate(self.params)
        ]
        first = first_bucket_bytes if first_bucket_bytes is not None else min(
            bucket_cap_bytes, 1024 * 1024
        )  # fmt: skip
        self.plans = plan_buckets(specs, bucket_cap_bytes, first)
        # join_flag: one extra element after the last bucket's gradients carries "this rank is
        # still training" (1) or "joined, shadowing" (0), so a joined rank learns from the
        # round itself whether anyone still trains — no extra collective per step.
        self.join_flag = join_flag
        last = len(self.plans) - 1
        self.buckets = [
            _Bucket(i, plan, [self.params[j] for j in plan.params], int(join_flag and i == last))
            for i, plan in enumerate(self.plans)
        ]
        self.where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for k, j in enumerate(self.plans[b.index].params):
                self.where[j] = (b.index, k)
        self.shadowing = False
        self.wait_seconds = 0.0
        """Time spent at the end of backward waiting for communication (exposed comm)."""
        self.hook: Hook | None = None
        self.hook_state: Any = None
        self.enabled = True
        self._handles: list[Any] = []
        # Autograd runs each accelerator's backward on its own thread, so the hooks of a model
        # spread over several devices (model_parallel.split) race; torch's reducer locks too.
        self._lock = threading.Lock()
        self._reset()
        if grad_as_bucket_view:
            for p, (bi, k) in zip(self.params, self.where):
                p.grad = self.buckets[bi].views[k]
        for j, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(j)))

    # ---- per-iteration state ------------------------------------------------------------
    def _reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.next_launch = 0
        self.queued = False
        for b in self.buckets:
            b.pending = len(b.params)
            b.divided = [False] * len(b.params)
            b.future = None

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper is being discarded)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- backward -----------------------------------------------------------------------
    def _make_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.enabled:
                with self._lock:
                    self._mark_ready(j, param)

        return hook

    def _mark_ready(self, j: int, param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        if self.ready[j]:
            raise RuntimeError(
                f"parameter {self.names[j]!r} produced a gradient twice in one backward pass; "
                f"DistributedDataParallel supports one gradient per parameter per iteration "
                f"(use static_graph=True is not a fix here: restructure the reentrant backward)"
            )
        self.ready[j] = True
        bi, k = self.where[j]
        bucket = self.buckets[bi]
        self._stage(bucket, k, param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _stage(self, bucket: _Bucket, k: int, param: torch.Tensor) -> None:
        view, grad = bucket.views[k], param.grad
        if grad is None:
            view.zero_()
            bucket.divided[k] = True
        elif grad.data_ptr() != view.data_ptr():
            if self.hook is None:
                # Fold the 1/N of the average into the copy: one pass over the gradient, not two.
                torch.div(grad, self.world_size, out=view)
                bucket.divided[k] = True
            else:
                view.copy_(grad)  # hooks receive local gradients
            if self.grad_as_view:
                param.grad = view

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.pending != 0:
                return
            bucket.future = self._communicate(bucket)
            self.next_launch += 1

    def _communicate(self, bucket: _Bucket) -> torch.futures.Future[torch.Tensor]:
        if self.join_flag and bucket.index == len(self.buckets) - 1:
            bucket.buffer[-1] = 0.0 if self.shadowing else 1.0
        if self.hook is not None:
            gb = GradBucket(
                bucket.index, bucket.buffer, list(bucket.views), list(bucket.params),
                bucket.index == len(self.buckets) - 1,
            )  # fmt: skip
            return self.hook(self.hook_state, gb)
        if not any(bucket.divided):
            bucket.buffer.div_(self.world_size)
        elif not all(bucket.divided):  # some gradients accumulated in their bucket views
            for view, done in zip(bucket.views, bucket.divided):
                if not done:
                    view.div_(self.world_size)
        work = c.all_reduce(bucket.buffer, dist.ReduceOp.SUM, self.group, async_op=True)
        return _WaitFuture(work, bucket.buffer)  # type: ignore[return-value]

    # ---- end of backward: the single wait site ----------------------------------------------
    def finalize(self) -> None:
        """Wait for every bucket and write the averaged gradients back (autograd callback)."""
        try:
            missing = [j for j, r in enumerate(self.ready) if not r]
            if missing and not self.find_unused:
                self._drain()
                raise UnusedParameterError(self._unused_message(missing))
            unused = set(self._fill_unused(missing)) if self.find_unused else set()
            for b in self.buckets:  # copying bucket i back overlaps bucket i+1's transfer
                self._wait(b)
                self._write_back(b, unused)
        finally:
            self._reset()

    def _fill_unused(self, missing: list[int]) -> list[int]:
        for j in missing:
            bi, k = self.where[j]
            self.buckets[bi].views[k].zero_()
            self.buckets[bi].pending -= 1
            self.ready[j] = True
        self._launch_ready()
        used = self._used_map()
        used[missing] = 0
        c.all_reduce(used, dist.ReduceOp.SUM, self.group)
        return used.eq(0).nonzero().flatten().tolist()

    def _used_map(self) -> torch.Tensor:
        device = self.buckets[0].buffer.device
        return torch.ones(len(self.params), dtype=torch.int32, device=device)

    def _drain(self) -> None:
        for b in self.buckets:
            self._wait(b)

    def _wait(self, b: _Bucket) -> None:
        if b.future is not None:
            start = time.perf_counter()
            result = b.future.wait()
            self.wait_seconds += time.perf_counter() - start
            if result is not b.buffer:
                self._check_hook_result(b, result)
                b.buffer.copy_(result)

    def _check_hook_result(self, b: _Bucket, result: Any) -> None:
        if not isinstance(result, torch.Tensor) or result.shape != b.buffer.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise ValueError(
                f"communication hook returned {got} for bucket {b.index}, expected a tensor of "
                f"shape {tuple(b.buffer.shape)} (the bucket's flat buffer, averaged)"
            )

    def _write_back(self, b: _Bucket, globally_unused: set[int]) -> None:
        for k, j in enumerate(self.plans[b.index].params):
            p, view = b.params[k], b.views[k]
            if j in globally_unused:
                continue
            if p.grad is None:
                p.grad = view if self.grad_as_view else view.clone()
            elif p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)

    def _unused_message(self, missing: list[int]) -> str:
        rank = dist.get_rank()
        names = ", ".join(repr(self.names[j]) for j in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        return (
            f"[rank {rank}] DistributedDataParallel: {len(missing)} parameter(s) received no "
            f"gradient in this backward pass: {names}{more}. Either make them take part in "
            f"computing the loss, set requires_grad=False on them, or pass "
            f"find_unused_parameters=True to DistributedDataParallel."
        )

    # ---- Join: shadow the collectives of one iteration with zeros -----------------------------
    def shadow_iteration(self) -> bool:
        """Issue this iteration's bucket collectives with zero gradients (joined rank).

        Returns:
            With ``join_flag``: whether any rank still trained in this round (else True).
        """
        self.shadowing = True
        try:
            for b in self.buckets:
                b.buffer.zero_()
                b.pending = 0
            self._launch_ready()
            if self.find_unused:
                c.all_reduce(self._used_map().zero_(), dist.ReduceOp.SUM, self.group)
            self._drain()
            return not self.join_flag or bool(self.buckets[-1].buffer[-1] > 0)
        finally:
            self.shadowing = False
            self._reset()


class _WaitFuture:
    """Minimal future over a tracked work: ``wait()`` reports failures with phalanx's errors."""

    def __init__(self, work: Any, value: torch.Tensor) -> None:
        self._work, self._value = work, value

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._value

    def value(self) -> torch.Tensor:
        return self._value
