"""``DistributedOptimizer``'s all-reduce during backward, on DDP's ``Reducer`` (the bucket engine).

The reducer launches each bucket's all-reduce as soon as its gradients are in and waits for them
all at the end of backward, so ``optimizer.step()`` finds averaged gradients. What Horovod adds
is layered on top:

* each backward pass that all-reduces announces itself in a negotiation round
  (``controller.py``), started at its first gradient and completed at its end, so it travels
  while backward computes: a rank in ``join()`` learns from it to shadow the pass with zero
  gradients, and ranks that diverged (one in backward, one in another operation) both raise;
* ``op``, ``compression`` and ``gradient_predivide_factor`` become a communication hook (plain
  averaging keeps the reducer's own path, which folds 1/N into the copy into the bucket);
* ``backward_passes_per_step=k``: a hook on every parameter counts backward passes (it is
  registered before the reducer's, so it sees each gradient first), and at the end of each pass
  the reducer's ``require_backward_grad_sync`` is set for the next one only if that one is a
  k-th, so gradients accumulate
  locally in between and travel once; a ``step()`` before the k-th pass all-reduces what has
  accumulated (Horovod's ``synchronize``);
* sparse gradients (``nn.Embedding(sparse=True)``) are all-gathered at ``synchronize()``, as
  Horovod does (their bucket slot carries zeros), or, with ``sparse_as_dense=True``, all-reduced
  densely and turned back into sparse tensors for the optimizer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.objects import all_gather_object
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.reducer import Hook, Reducer
from phalanx.horovod.allreduce import ReduceOp, launch
from phalanx.horovod.compression import NoneCompressor
from phalanx.horovod.controller import NEUTRAL
from phalanx.horovod.grouped import submit_grouped
from phalanx.horovod.handle import Handle
from phalanx.horovod.process_sets import ProcessSet, controller, global_process_set
from phalanx.horovod.protocol import Kind
from phalanx.horovod.requests import Agreement, Request
from phalanx.horovod.sparse import sparse_allreduce_async

__all__ = ["GradientSync", "bucket_cap_bytes", "check_same_parameters", "make_comm_hook"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def _scales(op: ReduceOp, predivide: float) -> tuple[float, float]:
    # Horovod splits the average: x / f before the sum, * f / N after (N applied by Average).
    return (1.0 / predivide, predivide) if op == ReduceOp.Average else (1.0, 1.0)


def make_comm_hook(op: ReduceOp, compression: Any, predivide: float) -> Hook | None:
    """The bucket hook for ``op`` / ``compression`` / predivide; None for plain averaging."""
    if op == ReduceOp.Average and compression is NoneCompressor and predivide == 1.0:
        return None
    pre, post = _scales(op, predivide)

    def hook(group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        wire, ctx = compression.compress(bucket.buffer())
        works, finish = launch([wire], op, pre, post, group)

        def result() -> torch.Tensor:
            finish()
            return compression.decompress(wire, ctx)

        return cast(torch.futures.Future[torch.Tensor], Handle(works, result))

    return hook


def bucket_cap_bytes(params: list[nn.Parameter], groups: int) -> int:
    """Bucket size: total / ``groups`` when given, else ``HOROVOD_FUSION_THRESHOLD`` or 25 MiB."""
    if groups > 0:
        total = sum(p.numel() * p.element_size() for p in params)
        return max(1, math.ceil(total / groups))
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if raw is None:
        return DEFAULT_BUCKET_BYTES
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r} must be a positive number of bytes")
    return int(raw)


def check_same_parameters(named: list[tuple[str, nn.Parameter]], group: Any) -> None:
    """Every rank must synchronise the same parameters (names, shapes, dtypes), in order: a
    RuntimeError on every rank otherwise, as for any operation the ranks disagree on."""
    mine = [[n, list(p.shape), str(p.dtype)] for n, p in named]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    all_gather_object(everyone, mine, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for rank, theirs in zip(ranks, everyone):
        if theirs != everyone[0]:
            raise CollectiveMismatchError(_difference(everyone[0], theirs, rank))


def _difference(ref: list[Any], other: list[Any], rank: int) -> str:
    head = f"[rank {dist.get_rank()}] DistributedOptimizer: the parameters on rank {rank} differ"
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return (
                f"{head} at position {i}: {a[0]!r} {a[1]} {a[2]} on the first rank, {b[0]!r} "
                f"{b[1]} {b[2]} on rank {rank}; build the same model and optimizer everywhere"
            )
    return f"{head}: {len(ref)} parameters on the first rank, {len(other)} on rank {rank}"


def _nothing(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], None]]:
    return [], lambda: None  # the reducer launches the pass's all-reduces itself


def _shadow(desc: dict[str, Any]) -> Request:
    """A joined rank's part in a pass: the same bucket all-reduces, with zero gradients."""
    key = desc["key"].split(".", 1)[1]
    sync = controller(global_process_set).optimizers.get(key)
    if sync is None:
        raise RuntimeError(
            f"[rank {dist.get_rank()}] join(): the other ranks run "
            f"DistributedOptimizer #{key}, which this rank does not have; build "
            f"the same optimizers on every rank"
        )

    def start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], None]]:
        sync.reducer.shadow_iteration()
        return [], lambda: None

    return Request(Kind.OPTIMIZER, None, [], start)


NEUTRAL[Kind.OPTIMIZER] = _shadow


class GradientSync:
    """Owns the reducer, the pass counter and the catch-up all-reduce of one optimizer."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        ps: ProcessSet,
        compression: Any,
        op: ReduceOp,
        predivide: float,
        passes_per_step: int,
        cap_bytes: int,
        first_bucket_bytes: int | None,
        find_unused: bool,
        sparse_as_dense: bool,
    ) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.ps, self.compression, self.op, self.predivide = ps, compression, op, predivide
        self.passes_per_step = passes_per_step
        self.passes = 0  # backward passes whose gradients have not been all-reduced yet
        self.sparse_as_dense = sparse_as_dense
        self._in_pass = False
        self._announced: Callable[[], None] | None = None
        self._sparse: dict[int, torch.Tensor] = {}  # sparse gradients waiting for synchronize()
        self._densified: set[int] = set()  # sparse_as_dense: back to sparse after synchronize()
        # Registered before the reducer's hooks, so they run first on every gradient.
        self._handles = [
            p.register_post_accumulate_grad_hook(self._prepare_hook(j))
            for j, p in enumerate(self.params)
        ]
        self.reducer = Reducer(
            named,
            ps.group,
            cap_bytes,
            find_unused,
            grad_as_bucket_view=False,
            first_bucket_bytes=first_bucket_bytes,
        )
        self.key = controller(ps).add_optimizer(self)
        self.reducer.hook = make_comm_hook(op, compression, predivide)
        self.reducer.hook_state = ps.group
        self._arm()

    def _prepare_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._in_pass:
                self._in_pass = True
                self.passes += 1
                torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
                if self.reducer.require_backward_grad_sync:
                    self._announce()
            if param.grad is not None and param.grad.is_sparse:
                self._sparse_grad(j, param)

        return hook

    def _announce(self) -> None:
        """Start this pass's negotiation round before its first bucket is launched; it travels
        while backward computes and is completed at the end of the pass."""
        req = Request(Kind.OPTIMIZER, self.key, [], _nothing)
        self._announced = controller(self.ps).submit_overlapped(req)

    def _sparse_grad(self, j: int, param: torch.Tensor) -> None:
        assert param.grad is not None
        if self.sparse_as_dense:
            param.grad = param.grad.to_dense()
            self._densified.add(j)
        elif self.reducer.require_backward_grad_sync:  # all-gathered at synchronize()
            # (the bucket carries zeros)
            self._sparse[j] = param.grad
            param.grad = None

    def _end_pass(self) -> None:
        self._in_pass = False
        if self._announced is not None:  # before the reducer's wait: a joined rank shadows
            announced, self._announced = self._announced, None
            announced()
        if self.reducer.require_backward_grad_sync:  # this pass was all-reduced
            self.passes = 0
            if self._sparse or self._densified:  # runs after the reducer's write-back
                torch.autograd.Variable._execution_engine.queue_callback(self._sparse_again)
        self._arm()

    def _sparse_again(self) -> None:
        """Gradients that were sparse are sparse again (the local ones until synchronize())."""
        for j, grad in self._sparse.items():
            self.params[j].grad = grad
        self._resparsify()

    def _resparsify(self) -> None:
        for j in sorted(self._densified):
            grad = self.params[j].grad
            if grad is not None and not grad.is_sparse:
                self.params[j].grad = grad.to_sparse()
        self._densified.clear()

    def _arm(self) -> None:
        """Enable the reducer for the next backward pass iff it completes a step's passes."""
        self.reducer.require_backward_grad_sync = self.passes + 1 >= self.passes_per_step

    def set_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step``; restarts the count."""
        self.passes_per_step = passes
        self.reset()

    def reset(self) -> None:
        """Forget the passes counted so far (a new accumulation window starts)."""
        self.passes = 0
        self._in_pass = False
        self._arm()

    def synchronize(self) -> None:
        """All-reduce what earlier passes left local; all-gather sparse gradients."""
        if self.passes > 0:
            self._catch_up()
        if self._sparse:
            self._gather_sparse()
        self._resparsify()

    def _catch_up(self) -> None:
        grads = []
        for p in self.params:
            if p.grad is None:  # as Horovod: a missing gradient counts as zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        packed = [self.compression.compress(g) for g in grads]
        pre, post = _scales(self.op, self.predivide)
        wires = [w for w, _ in packed]
        submit_grouped(wires, self.op, pre, post, self.ps, inplace=True).wait()
        for p, g, wire, (_, ctx) in zip(self.params, grads, wires, packed):
            if wire is not g:
                g.copy_(self.compression.decompress(wire, ctx))
            if p.grad is not g:  # was sparse
                p.grad = g.to_sparse()
        self._sparse.clear()
        self.reset()

    def _gather_sparse(self) -> None:
        handles = [
            (j, sparse_allreduce_async(grad, self.names[j], self.op, self.ps))
            for j, grad in sorted(self._sparse.items())
        ]
        self._sparse.clear()
        for j, result in handles:
            self.params[j].grad = result()

    def remove_hooks(self) -> None:
        """Detach from the parameters."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reducer.remove_hooks()
