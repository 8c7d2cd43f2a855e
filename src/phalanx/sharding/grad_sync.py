"""Bucketed reduce-scatter of gradients into shards, and all-gather of updated shards (ZeRO-1/2).

Stage 2 launches a bucket's reduce-scatter from the parameters' post-accumulate-grad hooks
during backward, as soon as the bucket and every bucket before it are complete (all ranks
launch the same buckets in the same order), and frees each parameter's full gradient once it
is copied into the bucket's staging buffer: a rank keeps its gradient shard plus at most
:data:`MAX_IN_FLIGHT` buckets. Stage 1 runs the same reduction at ``step()`` (so the full
gradients, 4Ψ bytes, live from backward to step, as the ZeRO-1 formula counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.sharding.layout import BucketLayout, ShardLayout

__all__ = ["MAX_IN_FLIGHT", "ShardSync"]

MAX_IN_FLIGHT = 2
"""Buckets whose collective may be outstanding at once (each holds one staging buffer)."""


@dataclass
class _Flight:
    bucket: int
    work: dist.Work | None
    out: torch.Tensor
    staging: torch.Tensor


class ShardSync:
    """Moves gradients into and parameters out of this rank's shards, bucket by bucket."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        shards: Sequence[nn.Parameter],
        flat: torch.Tensor,
        layout: ShardLayout,
        group: dist.ProcessGroup | None,
        rank: int,
        stage: int,
    ) -> None:
        self.params, self.shards, self.flat = params, shards, flat
        self.layout, self.group, self.rank, self.stage = layout, group, rank, stage
        self.world = layout.world
        biggest = max((b.chunk * self.world for b in layout.buckets), default=0)
        self._pool = [
            torch.empty(biggest, dtype=flat.dtype, device=flat.device) for _ in range(MAX_IN_FLIGHT)
        ]
        self._grads: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._bucket_of = {p: i for i, b in enumerate(layout.buckets) for p in b.params}
        self._ready = [0] * len(layout.buckets)
        self._next = 0
        self._flights: list[_Flight] = []
        self._armed = False
        self.reduced = False
        """True once this iteration's gradients are in the shards (reset by ``zero_grad``)."""
        self.require_sync = True
        self.handles = []
        if stage == 2:
            for i, p in enumerate(params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    # ---- backward (stage 2) --------------------------------------------------------------------
    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        def hook(_: torch.Tensor) -> None:
            if not self.require_sync:
                return
            if not self._armed:
                self._armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            b = self._bucket_of[index]
            self._ready[b] += 1
            buckets = self.layout.buckets
            while self._next < len(buckets) and self._ready[self._next] == len(
                buckets[self._next].params
            ):
                self._launch(self._next)
                self._next += 1

        return hook

    def _end_backward(self) -> None:
        self._armed = False
        self.flush()

    # ---- reduce-scatter ------------------------------------------------------------------------
    def _staging(self) -> torch.Tensor:
        if len(self._flights) >= MAX_IN_FLIGHT:
            self._complete(self._flights.pop(0))
        busy = {id(f.staging) for f in self._flights}
        return next(s for s in self._pool if id(s) not in busy)

    def _launch(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        pool = self._staging()
        stage = pool[: bucket.chunk * self.world]
        _fill(stage, bucket, self.params)
        for p in bucket.params:  # copied: the full gradient is not needed any more
            self.params[p].grad = None
        out = torch.empty(bucket.chunk, dtype=stage.dtype, device=stage.device)
        work = c.reduce_scatter_tensor(out, stage, group=self.group, async_op=True)
        self._flights.append(_Flight(index, work, out, pool))

    def _complete(self, flight: _Flight) -> None:
        if flight.work is not None:
            flight.work.wait()
        b = flight.bucket
        flight.out.div_(self.world)  # sum -> average (``out`` is the shard itself when fresh)
        grad = self._grads[b]
        if grad is None:
            grad = self._grads[b] = flight.out
        else:
            grad.add_(flight.out)
        self.shards[b].grad = grad[: self.shards[b].numel()]

    def flush(self) -> None:
        """Launch every bucket not yet launched this pass (in order) and wait for all."""
        while self._next < len(self.layout.buckets):
            self._launch(self._next)
            self._next += 1
        while self._flights:
            self._complete(self._flights.pop(0))
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0
        self.reduced = True

    def ensure_reduced(self) -> None:
        """Reduce now unless a synchronised backward already did (stage 1 always reduces here)."""
        if not self.reduced:
            self.flush()

    def zero_grad(self) -> None:
        """Free the gradient shards."""
        for s in self.shards:
            s.grad = None
        self._grads = [None] * len(self.layout.buckets)
        self.reduced = False

    def grad_bytes(self) -> int:
        """Bytes of gradient shards currently held."""
        return sum(g.numel() * g.element_size() for g in self._grads if g is not None)

    # ---- all-gather ----------------------------------------------------------------------------
    def gather_params(self) -> None:
        """Every rank broadcasts its updated shards into everyone's flat parameter buffer."""
        flights: list[tuple[BucketLayout, dist.Work | None, torch.Tensor]] = []
        pool = list(self._pool)
        for bucket in self.layout.buckets:
            if len(flights) >= MAX_IN_FLIGHT:
                pool.append(self._unpack(*flights.pop(0)))
            buf = pool.pop(0)
            chunk = bucket.chunk
            stage = buf[: chunk * self.world]
            mine = stage[self.rank * chunk : (self.rank + 1) * chunk]
            s, e = bucket.shard(self.rank)
            mine[: e - s].copy_(self.flat[s:e])
            work = c.all_gather_into_tensor(stage, mine, group=self.group, async_op=True)
            flights.append((bucket, work, buf))
        for flight in flights:
            self._unpack(*flight)

    def _unpack(
        self, bucket: BucketLayout, work: dist.Work | None, buf: torch.Tensor
    ) -> torch.Tensor:
        if work is not None:
            work.wait()
        chunk = bucket.chunk
        for r in range(self.world):
            if r == self.rank:
                continue
            s, e = bucket.shard(r)
            self.flat[s:e].copy_(buf[r * chunk : r * chunk + e - s])
        return buf


def _fill(stage: torch.Tensor, bucket: BucketLayout, params: Sequence[nn.Parameter]) -> None:
    """Copy the bucket's gradients (zeros where a parameter has none) into ``stage``."""
    chunk = bucket.chunk
    for r, (s, e) in enumerate(bucket.part.bounds):
        if e - s < chunk:
            stage[r * chunk + e - s : (r + 1) * chunk].zero_()
    for seg in bucket.segments:
        grad = params[seg.param].grad
        dst = stage[seg.staging : seg.staging + seg.length]
        if grad is None:
            dst.zero_()
        else:
            dst.copy_(grad.reshape(-1)[seg.param_start : seg.param_start + seg.length])
