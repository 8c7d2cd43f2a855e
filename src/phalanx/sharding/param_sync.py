"""All-gather of the updated parameters after a ZeRO-1/2 step, bucket by bucket.

Each rank copies its range of a bucket into its slot of a staging buffer, the buffer is
all-gathered (every rank's chunk lands in everyone's buffer), and each rank copies the other
ranks' ranges back into its parameters. With ``parameters_as_bucket_view`` the parameters are
views of one contiguous buffer per bucket, so a rank's range is one slice and each copy is one
``copy_`` per rank; otherwise each parameter keeps its own storage and the copies go parameter
piece by parameter piece. At most :data:`MAX_IN_FLIGHT` buckets are on the wire at once. The
all-gather's chunk is the largest range (:attr:`BucketLayout.part`'s chunk): the gradient flags
of the reduce-scatter's chunk do not travel here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.bucket_state import bucket_storage
from phalanx.sharding.layout import BucketLayout, CopyRun, ShardLayout

__all__ = ["MAX_IN_FLIGHT", "ParamGatherer", "StagingPool"]

MAX_IN_FLIGHT = 2
"""Buckets whose collective may be outstanding at once (each holds one staging buffer)."""


class StagingPool:
    """:data:`MAX_IN_FLIGHT` buffers as large as the largest bucket's staging buffer, in the
    group's shared memory where its backend gives that (``bucket_storage``: backend 'shm'), so
    that the reduce-scatter and all-gather through them copy nothing in or out. Collective."""

    def __init__(
        self,
        layout: ShardLayout,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        biggest = max((b.chunk * layout.world for b in layout.buckets), default=0)
        self.buffers = [
            bucket_storage(group, biggest, dtype, device)
            if layout.world > 1
            else torch.zeros(biggest, dtype=dtype, device=device)
            for _ in range(MAX_IN_FLIGHT)
        ]


class ParamGatherer:
    """Broadcasts every rank's updated ranges into every rank's parameters."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: ShardLayout,
        buffers: Sequence[torch.Tensor] | None,
        pool: StagingPool,
        group: dist.ProcessGroup | None,
        rank: int,
    ) -> None:
        self.params, self.layout, self.buffers = params, layout, buffers
        self.pool, self.group, self.rank = pool, group, rank
        runs = [_gather_runs(b, rank) for b in layout.buckets]
        self._mine, self._theirs = [m for m, _ in runs], [t for _, t in runs]

    def gather(self) -> None:
        """Every rank's ranges of every bucket into everyone's parameters (collective)."""
        if self.layout.world == 1:
            return
        flights: list[tuple[int, dist.Work | None, torch.Tensor]] = []
        free = list(self.pool.buffers)
        for b, bucket in enumerate(self.layout.buckets):
            if len(flights) >= MAX_IN_FLIGHT:
                free.append(self._unpack(*flights.pop(0)))
            buf = free.pop(0)
            chunk = bucket.part.chunk
            stage = buf[: chunk * self.layout.world]
            mine = stage[self.rank * chunk : (self.rank + 1) * chunk]
            self._pack(b, bucket, mine)
            work = c.all_gather_into_tensor(stage, mine, group=self.group, async_op=True)
            flights.append((b, work, buf))
        for flight in flights:
            self._unpack(*flight)

    def _pack(self, b: int, bucket: BucketLayout, mine: torch.Tensor) -> None:
        s, e = bucket.part.bounds[self.rank]
        if self.buffers is not None:
            mine[: e - s].copy_(self.buffers[b][s:e])
            return
        for param, at, elements in self._mine[b]:
            mine[at].copy_(self.params[param].detach().reshape(-1)[elements])

    def _unpack(self, b: int, work: dist.Work | None, buf: torch.Tensor) -> torch.Tensor:
        if work is not None:
            work.wait()
        bucket = self.layout.buckets[b]
        chunk = bucket.part.chunk
        if self.buffers is not None:
            for r, (s, e) in enumerate(bucket.part.bounds):
                if r != self.rank:
                    self.buffers[b][s:e].copy_(buf[r * chunk : r * chunk + e - s])
            return buf
        for param, at, elements in self._theirs[b]:
            self.params[param].detach().view(-1)[elements].copy_(buf[at])
        return buf


def _gather_runs(bucket: BucketLayout, rank: int) -> tuple[list[CopyRun], list[CopyRun]]:
    """The all-gather's copy runs: ``rank``'s (placed in its chunk) and the other ranks' (placed
    in the gathered buffer).

    The all-gather's chunk is ``part.chunk``, the reduce-scatter's (the staging offsets) that
    plus the flags: a run at staging offset ``o`` of rank ``r`` is ``o - r * bucket.chunk`` into
    its rank's range.
    """
    mine: list[CopyRun] = []
    theirs: list[CopyRun] = []
    for seg in bucket.segments:
        start = seg.piece.offset - seg.rank * bucket.chunk  # offset within the rank's range
        if seg.rank == rank:
            mine.append((seg.param, slice(start, start + seg.piece.numel), seg.piece.elements))
        else:
            at = seg.rank * bucket.part.chunk + start
            theirs.append((seg.param, slice(at, at + seg.piece.numel), seg.piece.elements))
    return mine, theirs
