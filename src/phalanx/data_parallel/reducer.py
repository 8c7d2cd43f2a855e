"""The bucketed gradient all-reduce engine shared by DistributedDataParallel and Horovod.

When a parameter's gradient is complete (a post-hook on its ``AccumulateGrad`` node, which runs
under local and dist autograd alike, see :mod:`grad_access`), it is copied into its flat bucket.
The bucket engine (:mod:`bucket_engine`) counts each bucket's ready gradients and launches a
complete bucket's asynchronous all-reduce at once, **in bucket order** (every rank must issue
collectives in the same order), so communication overlaps the rest of backward. A callback
queued on the autograd engine waits for every bucket once backward ends (the engine's one wait
site) before the optimizer can see a gradient.

Unused parameters: with ``find_unused`` they are filled in at the end of backward (their local
gradient, accumulated under ``no_sync`` perhaps, or zeros) and one all-reduce of a usage map
tells which are unused on every rank; those keep their gradient untouched. With ``static_graph``
the first iteration learns how many times each parameter's hook fires (a reentrant backward
fires it more than once) and which are unused; later iterations reduce a parameter when its
count is reached.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.comm import wait_clock
from phalanx.data_parallel.bucket_engine import BucketEngine
from phalanx.data_parallel.bucket_state import Bucket
from phalanx.data_parallel.buckets import ParamSpec, plan_buckets
from phalanx.data_parallel.grad_access import GradSite, hook_accumulator
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.static_graph import HookCounts
from phalanx.data_parallel.unused import UnusedParameterError

__all__ = ["Hook", "Reducer", "ReducerOptions"]

Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class ReducerOptions:
    """How the reducer treats unused parameters, views and sparse gradients."""

    find_unused: bool = False
    grad_as_bucket_view: bool = False
    static_graph: bool = False
    skip_unused: bool = False
    """Assume every rank leaves the same parameters unused: no usage all-reduce, and buckets
    holding only unused parameters are not reduced (torch's ``skip_all_reduce_unused_params``)."""
    batched_copy: bool = False
    """Copy a bucket's gradients in one batch when it is full (torch's ``batched_grad_copy``)."""
    sparse: frozenset[int] = frozenset()
    """Indices of the parameters whose gradients are sparse."""
    bucket_dtype: torch.dtype | None = None
    """Reduce in this dtype instead of the parameters' (mixed precision's ``reduce_dtype``)."""
    join_flag: bool = False
    """One extra element after the last bucket carries "still training" (1) or "joined" (0),
    so a joined rank learns from the round itself whether anyone still trains."""


class Reducer:
    """Owns the buckets, the hooks and the per-iteration state of gradient synchronisation."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | None,
        bucket_cap_bytes: int,
        find_unused: bool = False,
        grad_as_bucket_view: bool = False,
        first_bucket_bytes: int | None = None,
        join_flag: bool = False,
        *,
        caps: Sequence[int] | None = None,
        options: ReducerOptions | None = None,
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.options = options or ReducerOptions(
            find_unused, grad_as_bucket_view, join_flag=join_flag
        )
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        if caps is None:
            first = (
                min(bucket_cap_bytes, 1024 * 1024)
                if first_bucket_bytes is None
                else first_bucket_bytes
            )
            caps = (
                (min(first, bucket_cap_bytes), bucket_cap_bytes)
                if first > 0
                else (bucket_cap_bytes,)
            )
        self.plans = plan_buckets([self._spec(i, p) for i, p in enumerate(self.params)], caps)
        last = len(self.plans) - 1
        self.buckets = [
            Bucket(
                i,
                plan,
                [self.params[j] for j in plan.params],
                int(self.options.join_flag and i == last),
                self.options.bucket_dtype or self.params[plan.params[0]].dtype,
                self.group,
            )
            for i, plan in enumerate(self.plans)
        ]
        self.where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for k, j in enumerate(b.plan.params):
                self.where[j] = (b.index, k)
        self.counts = HookCounts(len(self.params)) if self.options.static_graph else None
        self.shadowing = False
        self.hook: Hook | None = None
        self.hook_state: Any = None
        self.require_backward_grad_sync = True
        """Whether the coming backward synchronises (set per forward by its owner)."""
        self.engine: BucketEngine[Any] = BucketEngine([len(b.params) for b in self.buckets], self)
        self.site = GradSite()
        """Where this iteration's gradients live (set per forward; dist autograd or local)."""
        self.divisor = self.world_size
        self.before_write_back: Callable[[], None] | None = None
        """Called once the gradients are staged, before the reduced ones are written back."""
        self.used = [False] * len(self.params)
        """Parameters with a gradient since the last synchronised backward (no_sync included)."""
        # Autograd runs each accelerator's backward on its own thread, so the hooks of a model
        # spread over several devices (model_parallel.split) race; torch's reducer locks too.
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._reset()
        if self.options.grad_as_bucket_view:
            for p, (bi, k) in zip(self.params, self.where):
                if not self.buckets[bi].sparse:
                    p.grad = self.buckets[bi].views[k]
        self._hooks: list[tuple[Any, Any]] = []
        self.rehook()

    def _spec(self, i: int, p: nn.Parameter) -> ParamSpec:
        dtype = self.options.bucket_dtype or p.dtype
        size = torch.empty(0, dtype=dtype).element_size()
        return ParamSpec(i, p.numel(), size, str(dtype), str(p.device), i in self.options.sparse)

    # ---- per-iteration state ------------------------------------------------------------
    def _reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.queued = False
        self.engine.reset()
        for b in self.buckets:
            b.reset()
        if self.counts is not None:
            self.counts.start_iteration()

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper is being discarded)."""
        for _, handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def rehook(self) -> None:
        """(Re)attach to each parameter's gradient accumulator: autograd replaces it when a
        parameter's ``.data`` changes dtype or device (mixed precision does, every forward)."""
        self.remove_hooks()
        self._hooks = [hook_accumulator(p, self._hook_for(j)) for j, p in enumerate(self.params)]

    # ---- backward -----------------------------------------------------------------------
    def _hook_for(self, j: int) -> Callable[[], None]:
        return lambda: self._on_gradient(j)

    def _on_gradient(self, j: int) -> None:
        with self._lock, torch.no_grad():
            grad = self.site.get(self.params[j])
            if grad is not None:
                self.used[j] = True
            if not self.require_backward_grad_sync:
                return
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
                self._start_iteration()
            if self.counts is not None and not self.counts.complete(j, self.names[j]):
                return
            if self.ready[j]:
                raise RuntimeError(
                    f"[rank {dist.get_rank()}] DistributedDataParallel: parameter "
                    f"{self.names[j]!r} produced a gradient twice in one backward pass (a "
                    f"reentrant backward, such as activation checkpointing): pass "
                    f"static_graph=True if the graph is the same every iteration"
                )
            self._ready(j, grad)

    def _start_iteration(self) -> None:
        if self.counts is not None and self.counts.learned:
            for j in self.counts.never_fire():  # known unused: staged up front, as torch does
                self._ready(j, self.site.get(self.params[j]))

    def _ready(self, j: int, grad: torch.Tensor | None) -> None:
        self.ready[j] = True
        bi, k = self.where[j]
        bucket = self.buckets[bi]
        self._check_layout(j, bucket, grad)
        if self.options.batched_copy and not bucket.sparse:
            bucket.defer(k, grad)
        else:
            bucket.stage(k, grad, None if self.hook is not None else self.divisor)
        if self._repoint_to_view(grad, bucket, k):
            self.params[j].grad = bucket.views[k]
        self.engine.ready(bi)

    def _repoint_to_view(self, grad: torch.Tensor | None, bucket: Bucket, k: int) -> bool:
        """With gradient_as_bucket_view, a fresh local gradient is replaced by its view."""
        if not self.options.grad_as_bucket_view or grad is None or bucket.sparse:
            return False
        local = self.site.context_id is None
        return local and grad.data_ptr() != bucket.views[k].data_ptr()

    def _check_layout(self, j: int, bucket: Bucket, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        bucket.check_layout(grad, self.names[j])
        if grad.requires_grad:
            self._warn_once(
                "create_graph",
                "DistributedDataParallel with backward(create_graph=True): the gradients are "
                "averaged, but higher-order gradients are not synchronised across ranks (as in "
                "torch's DDP)",
            )

    # ---- the engine's collective ----------------------------------------------------------------
    def launch(self, index: int) -> Any:
        """Start bucket ``index``'s all-reduce (or hook); None when it is skipped."""
        bucket = self.buckets[index]
        if bucket.skipped:
            return None
        bucket.flush()
        last = index == len(self.buckets) - 1
        if self.options.join_flag and last:
            bucket.buffer[-1] = 0.0 if self.shadowing else 1.0
        if self.hook is not None:
            return bucket.run_hook(self.hook, self.hook_state, last)
        return bucket.all_reduce(self.group, self.divisor)

    def complete(self, index: int, future: Any) -> None:
        """Wait for bucket ``index``'s result and take it into the bucket."""
        with wait_clock.blocked():
            result = future.wait()
        self.buckets[index].absorb(result)

    # ---- end of backward: the engine's wait site -------------------------------------------
    def finalize(self) -> None:
        """Wait for every bucket and write the averaged gradients back (autograd callback)."""
        with torch.no_grad():
            try:
                unused = self._complete_iteration()
                if self.before_write_back is not None:
                    self.before_write_back()
                for b in self.buckets:  # copying bucket i back overlaps bucket i+1's transfer
                    self.engine.wait(b.index)
                    self._write_back(b, unused)
                self.used = [False] * len(self.params)
            finally:
                self.site = GradSite()
                self._reset()

    def _complete_iteration(self) -> set[int]:
        """Stage what is missing and return the parameters unused on every rank."""
        if self.counts is not None:
            return self._complete_static(self.counts)
        missing = [j for j, r in enumerate(self.ready) if not r]
        if not self.options.find_unused:
            if missing:
                self._drain()
                raise UnusedParameterError.naming([self.names[j] for j in missing])
            return set()
        return self._fill_missing(missing)

    def _complete_static(self, counts: HookCounts) -> set[int]:
        if not counts.learned:  # first iteration: every gradient is complete only now
            counts.learn(self._fill_missing(list(range(len(self.params)))))
        else:
            try:
                counts.check_all_fired(self.ready, self.names)
            except RuntimeError:
                self._drain()
                raise
        return counts.globally_unused

    def _fill_missing(self, missing: list[int]) -> set[int]:
        skip = {j for j in missing if not self.used[j]} if self.options.skip_unused else set()
        for b in self.buckets:  # all ranks leave the same ones unused: no need to reduce them
            if skip and all(j in skip for j in b.plan.params):
                b.skipped = True
                self.engine.mark_complete(b.index)
        for j in missing:
            if not self.buckets[self.where[j][0]].skipped:
                self._ready(j, self.site.get(self.params[j]))
        self.engine.launch_ready()
        if self.options.skip_unused:
            return skip
        used = torch.tensor(self.used, dtype=torch.int32, device=self.buckets[0].buffer.device)
        c.all_reduce(used, dist.ReduceOp.SUM, self.group)
        return set(used.eq(0).nonzero().flatten().tolist())

    def _drain(self) -> None:
        self.engine.wait_all()

    def _write_back(self, b: Bucket, globally_unused: set[int]) -> None:
        for k, j in enumerate(b.plan.params):
            if j in globally_unused:
                continue  # as torch: a parameter unused on every rank keeps its gradient
            p, value = b.params[k], b.value(k)
            if self.site.context_id is not None:
                if not self.site.set(p, value):
                    self._warn_once(
                        "dist_unused",
                        f"parameter {self.names[j]!r} has no gradient "
                        "in this dist autograd context; it keeps none",
                    )
                continue
            grad = p.grad
            if grad is None or b.sparse:
                p.grad = value if self.options.grad_as_bucket_view or b.sparse else value.clone()
            elif grad.data_ptr() != value.data_ptr():
                grad.copy_(value)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=2)

    # ---- Join: shadow the collectives of one iteration with zeros -----------------------------
    def shadow_iteration(self) -> bool:
        """Issue one backward's collectives with zero gradients (a joined rank).

        Returns:
            With ``join_flag``: whether any rank still trained in this round (else True).
        """
        self.shadowing = True
        try:
            for b in self.buckets:
                if b.sparse:
                    b.stage(0, None, None)
                else:
                    b.buffer.zero_()
            self.engine.launch_all()
            if self.options.find_unused and not self.options.skip_unused:
                zeros = torch.zeros(
                    len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device
                )
                c.all_reduce(zeros, dist.ReduceOp.SUM, self.group)
            self._drain()
            return not self.options.join_flag or bool(self.buckets[-1].buffer[-1] > 0)
        finally:
            self.shadowing = False
            self._reset()
