"""Bucketed reduce-scatter of gradients into this rank's ranges (ZeRO-1/2's own averaging).

Stage 2 launches a bucket's reduce-scatter from the parameters' post-accumulate-grad hooks
during backward, as soon as the bucket and every bucket before it are complete (all ranks
launch the same buckets in the same order: the bucket engine,
:mod:`phalanx.data_parallel.bucket_engine`, with the reduce-scatter as its collective), and
frees each parameter's full gradient once it is copied into the bucket's staging buffer: a
rank keeps its gradient ranges plus at most
:data:`~phalanx.sharding.param_sync.MAX_IN_FLIGHT` buckets. Stage 1 runs the same reduction at
``step()`` (so the full gradients, 4Ψ bytes, live from backward to step, as the ZeRO-1 formula
counts them).

Each rank's chunk carries one gradient flag per parameter of the bucket (see
:mod:`phalanx.sharding.layout`): a range whose parameter had a gradient on no rank gets
``grad = None`` and is skipped by the optimizer, as ``torch.optim`` skips it.

Hybrid sharding: a reduced chunk is all-reduced over the replicate group (the ranks holding
the same ranges on other hosts) where the bucket is waited for; its flags then say whether any
rank of the world had a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.bucket_engine import BucketEngine
from phalanx.sharding.layout import BucketLayout, CopyRun, ShardLayout
from phalanx.sharding.owned import OwnedRange
from phalanx.sharding.param_sync import MAX_IN_FLIGHT, StagingPool

__all__ = ["GradReducer"]


@dataclass
class _Flight:
    work: dist.Work | None
    out: torch.Tensor
    staging: torch.Tensor


class GradReducer:
    """Moves the ranks' gradients, averaged, into this rank's owned ranges, bucket by bucket."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: ShardLayout,
        owned: list[list[OwnedRange]],
        pool: StagingPool,
        group: dist.ProcessGroup | None,
        stage: int,
        on_launch: Callable[[], None],
        replicate: dist.ProcessGroup | None = None,
    ) -> None:
        assert all(b.flags == len(b.params) for b in layout.buckets), "layout without flags"
        self.params, self.layout, self.owned, self.pool = params, layout, owned, pool
        self.group, self.stage, self.world = group, stage, layout.world
        self.replicate = replicate
        self.ranks = self.world * (dist.get_world_size(replicate) if replicate else 1)
        """Every rank the gradients average over (hybrid sharding: the replicas' too)."""
        self._on_launch = on_launch
        self._grads: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._bucket_of = {p: i for i, b in enumerate(layout.buckets) for p in b.params}
        self._runs = [b.copy_runs() for b in layout.buckets]
        self._slots = [[(r, r.piece.held) for r in mine] for mine in owned]
        self.engine: BucketEngine[_Flight] = BucketEngine(
            [len(b.params) for b in layout.buckets], self, MAX_IN_FLIGHT
        )
        self._armed = False
        self.reduced = False
        """True once this iteration's gradients are in the ranges (reset by each step)."""
        self.require_backward_grad_sync = True
        """False: the coming backward passes leave their gradients local (``no_sync``)."""
        self._handles: dict[int, Any] = {}
        self.refresh_hooks()

    # ---- backward (stage 2) --------------------------------------------------------------------
    def refresh_hooks(self) -> None:
        """Stage 2: hook every parameter that requires grad (also those unfrozen since)."""
        if self.stage != 2:
            return
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._handles:
                self._handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))

    def close(self) -> None:
        """Remove the hooks (the optimizer replaces this reducer after ``add_param_group``)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            if not self._armed:
                self._armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.engine.ready(self._bucket_of[index])

        return hook

    # ---- reduce-scatter: the engine's collective ----------------------------------------------
    def launch(self, index: int) -> _Flight:
        """Stage bucket ``index``'s gradients (freeing them) and start its reduce-scatter."""
        self._on_launch()
        bucket = self.layout.buckets[index]
        busy = {id(f.staging) for f in self.engine.in_flight()}  # the engine bounds the flights
        pool = next(s for s in self.pool.buffers if id(s) not in busy)
        stage = pool[: bucket.chunk * self.world]
        _fill(stage, bucket, self._runs[index], self.params)
        for p in bucket.params:  # copied: the full gradient is not needed any more
            self.params[p].grad = None
        out = torch.empty(bucket.chunk, dtype=stage.dtype, device=stage.device)
        work = None
        if self.world == 1:  # nothing to reduce (and perhaps no process group)
            out.copy_(stage)
        else:
            work = c.reduce_scatter_tensor(out, stage, group=self.group, async_op=True)
        return _Flight(work, out, pool)

    def complete(self, b: int, flight: _Flight) -> None:
        """Wait for bucket ``b``'s reduce-scatter and add its average to this rank's ranges."""
        if flight.work is not None:
            flight.work.wait()
        if self.replicate is not None:  # the same chunk on the other hosts
            c.all_reduce(flight.out, group=self.replicate)
        flight.out.div_(self.ranks)  # sum -> average (flags: > 0 iff some rank had a gradient)
        grad = self._grads[b]
        if grad is None:
            grad = self._grads[b] = flight.out
        else:
            grad.add_(flight.out)
        has = (grad[self.layout.buckets[b].flag_offset :] > 0).tolist()  # one sync per bucket
        for r, slot in self._slots[b]:
            r.tensor.grad = grad[slot].view(r.tensor.shape) if has[r.flag] else None

    def flush(self) -> None:
        """Launch every bucket not yet launched this pass (in order) and wait for all."""
        self._armed = False
        self.engine.launch_all()
        self.engine.wait_all()
        self.engine.reset()
        self.reduced = True

    def ensure_reduced(self) -> None:
        """Reduce now unless a synchronised backward already did (stage 1 always reduces here)."""
        if not self.reduced:
            self.flush()

    def zero_grad(self) -> None:
        """Free the reduced gradients."""
        for mine in self.owned:
            for r in mine:
                r.tensor.grad = None
        self._grads = [None] * len(self.layout.buckets)
        self.reduced = False

    def grad_bytes(self) -> int:
        """Bytes of reduced gradients currently held."""
        return sum(g.numel() * g.element_size() for g in self._grads if g is not None)


def _fill(
    stage: torch.Tensor, bucket: BucketLayout, runs: list[CopyRun], params: Sequence[torch.Tensor]
) -> None:
    """Copy the bucket's gradients (zeros where a parameter has none) and flags into ``stage``."""
    chunk, at = bucket.chunk, bucket.flag_offset
    flags = torch.tensor([params[p].grad is not None for p in bucket.params], dtype=stage.dtype).to(
        stage.device
    )
    for r, (s, e) in enumerate(bucket.part.bounds):
        stage[r * chunk + e - s : r * chunk + at].zero_()
        stage[r * chunk + at : (r + 1) * chunk].copy_(flags)
    for param, held, elements in runs:
        grad = params[param].grad
        if grad is None:
            stage[held].zero_()
        else:
            stage[held].copy_(grad.reshape(-1)[elements])
