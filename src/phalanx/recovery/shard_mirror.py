"""Peers are the checkpoint of sharded state: each ZeRO rank keeps its neighbour's shards in memory.

Under ZeRO a lost rank takes its shard of the optimizer state (ZeRO-3: of the parameters too)
with it. A :class:`ShardMirror` on every rank of a ZeRO group of ``W`` ranks keeps, in memory,
a copy of rank ``(r + 1) % W``'s pieces on rank ``r``, refreshed every ``every`` optimizer steps
(the ring idea of Gemini, Wang et al. 2023, and of in-memory checkpointing):

1. right after the optimizer step, the training thread copies its own pieces into a staging
   buffer (:mod:`.shard_snapshot`: one memcpy per piece) — this rank's own *snapshot*;
2. a background thread sends that buffer to the left neighbour and receives the right
   neighbour's over a dedicated gloo group, so the exchange overlaps the next steps; the next
   refresh, or :meth:`ShardMirror.wait`, joins it (one owner, one wait site).

A rank keeps its own snapshots of the last two refreshes and the mirrors of the last two
(the newest arrives in the background): after a loss, the survivors restore to the newest step
for which every survivor has its own snapshot and the lost rank's holder has its mirror
(:func:`phalanx.recovery.restore_shards`), so a loss during an exchange still finds one
consistent step. Memory: up to four buffers of one rank's shard state (:meth:`held_bytes`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx._check import check_float, check_group, check_instance, check_int, fail
from phalanx.comm.codec import decode, encode
from phalanx.recovery.shard_snapshot import Snapshot, pack, sections_of
from phalanx.recovery.sockets import GroupSockets, socket_fds
from phalanx.sharding.zero import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel

__all__ = ["RefreshStats", "ShardMirror"]

KEEP = 2  # snapshots (own and mirrored) kept per rank: the newest and the one before


@dataclass
class RefreshStats:
    """Where a mirror's time went, summed over its refreshes (seconds)."""

    refreshes: int = 0
    copy_s: float = 0.0
    """Training thread: copying own pieces into the staging buffer."""
    copy_cpu_s: float = 0.0
    """The same in CPU time of the training thread (what a loaded machine does not inflate)."""
    wait_s: float = 0.0
    """Training thread: blocked joining an exchange not yet finished."""
    exchange_s: float = 0.0
    """Background thread: sending own buffer, receiving the neighbour's."""
    exchange_cpu_s: float = 0.0
    """The same in CPU time of the background thread."""


@dataclass
class _Exchange:
    mirror: Snapshot | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def _send(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> dist.Work:
    work = dist.isend(t, group=group, group_dst=dst)
    assert work is not None
    return work


def _recv(t: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    dist.recv(t, group=group, group_src=src)
    return t


def _exchange(
    snap: Snapshot, group: dist.ProcessGroup, left: int, right: int, spare: torch.Tensor | None
) -> _Exchange:
    """Send ``snap`` to ``left`` and receive ``right``'s snapshot (background thread)."""
    out = _Exchange()
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        text = torch.frombuffer(bytearray(encode(snap.manifest)), dtype=torch.uint8)
        header = torch.tensor([text.numel(), snap.nbytes, snap.step], dtype=torch.int64)
        sends = [_send(header, left, group), _send(text, left, group)]
        if snap.nbytes:  # gloo: no empty messages
            sends.append(_send(snap.buffer, left, group))
        n_text, n_bytes, step = (
            int(v) for v in _recv(torch.empty(3, dtype=torch.int64), right, group)
        )
        got = _recv(torch.empty(n_text, dtype=torch.uint8), right, group)
        manifest = decode(got.numpy().tobytes())
        fits = spare is not None and spare.numel() == n_bytes
        buffer = spare if spare is not None and fits else torch.empty(n_bytes, dtype=torch.uint8)
        if n_bytes:
            _recv(buffer, right, group)
        out.mirror = Snapshot(step, manifest, buffer)
        for work in sends:
            work.wait()
    except BaseException as exc:  # handed to the training thread by wait()
        out.error = exc
    out.seconds = time.perf_counter() - start
    out.cpu_seconds = time.thread_time() - cpu
    return out


class ShardMirror:
    """Keep the right neighbour's ZeRO shards in this rank's memory, refreshed in the background.

    Args:
        optimizer: A :class:`~phalanx.sharding.ZeroRedundancyOptimizer` (stages None, 1, 2),
            or, with ``model``, the ``torch.optim`` optimizer over its ``parameters()``.
        model: A :class:`~phalanx.sharding.zero3.FullyShardedDataParallel` (ZeRO-3), or None.
        every: Refresh every this many optimizer steps (an int >= 1): fewer copies and
            less traffic, an older restore point.
            A group of one rank keeps its own snapshots only (no neighbour to send them to).
        exchange_group: A gloo group over the same ranks as the ZeRO group, in the same order,
            for the exchange only. None: one is made with ``dist.new_group`` — collective over
            the default group, so every rank of it must build its mirror at the same time.
        timeout: Collective timeout in seconds of the group made when ``exchange_group`` is
            None (None: torch's default for gloo, 30 minutes).

    Call :meth:`after_step` after every optimizer step with the number of steps done, and
    :meth:`wait` before the job ends. After a loss, :meth:`close` it before the group is torn
    down, restore with :func:`~phalanx.recovery.restore_shards`, then build a new mirror over
    the new optimizer (its exchange group is made over the new group).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: FullyShardedDataParallel | None = None,
        *,
        every: int = 1,
        exchange_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
    ) -> None:
        where = "ShardMirror"
        self.every = check_int("every", every, min=1, where=where)
        limit = None
        if timeout is not None:
            limit = timedelta(seconds=check_float("timeout", timeout, above=0, where=where))
        zero_group = _zero_group(optimizer, model)
        exchange_group = check_group("exchange_group", exchange_group, where=where)
        self.optimizer, self.model = optimizer, model
        self.kind = "zero3" if model is not None else "zero"
        self.world = dist.get_world_size(zero_group)
        self.rank = dist.get_rank(zero_group)
        self._sockets = GroupSockets()
        """The connections of the exchange group this mirror made (see :meth:`close`)."""
        if exchange_group is None:
            ranks = dist.get_process_group_ranks(zero_group) if zero_group is not None else None
            before = socket_fds()
            exchange_group = dist.new_group(ranks, backend="gloo", timeout=limit)
            self._sockets = GroupSockets.opened_since(before)
        size = dist.get_world_size(exchange_group)
        if size != self.world:
            raise fail(
                "exchange_group",
                exchange_group,
                f"a group of {self.world} ranks (the ZeRO group's), not {size}",
                where=where,
            )
        self.group = exchange_group
        self.own: list[Snapshot] = []
        """This rank's snapshots, oldest first (at most two)."""
        self.mirrors: list[Snapshot] = []
        """The right neighbour's snapshots, oldest first (at most two)."""
        self.stats = RefreshStats()
        self._thread: threading.Thread | None = None
        self._outcome = _Exchange()

    @property
    def neighbour(self) -> int:
        """The rank (of the ZeRO group) whose shards this rank mirrors."""
        return (self.rank + 1) % self.world

    def after_step(self, step: int) -> bool:
        """Refresh when ``step`` (optimizer steps done) is a multiple of ``every``; say if so."""
        step = check_int("step", step, min=0, where="ShardMirror.after_step")
        if step % self.every:
            return False
        self.refresh(step)
        return True

    def refresh(self, step: int) -> None:
        """Snapshot this rank's pieces as of ``step`` and start sending them to the left
        neighbour (joins the previous exchange first, raising its error)."""
        step = check_int("step", step, min=0, where="ShardMirror.refresh")
        if self.own and step <= self.own[-1].step:
            raise ValueError(
                f"ShardMirror.refresh: step must grow, got {step} after {self.own[-1].step}"
            )
        self.wait()
        start, cpu = time.perf_counter(), time.thread_time()
        reuse = self.own[0].buffer if len(self.own) == KEEP else None
        snap = pack(step, self.kind, sections_of(self.optimizer, self.model), reuse)
        self.own = [*self.own[-(KEEP - 1) :], snap]
        spare = self.mirrors[0].buffer if len(self.mirrors) == KEEP else None
        self.mirrors = self.mirrors[-(KEEP - 1) :]
        self.stats.copy_s += time.perf_counter() - start
        self.stats.copy_cpu_s += time.thread_time() - cpu
        self.stats.refreshes += 1
        if self.world == 1:
            return
        left = (self.rank - 1) % self.world
        args = (snap, self.group, left, self.neighbour, spare)
        self._thread = threading.Thread(
            target=self._run, args=args, name=f"phalanx-shard-mirror-{self.rank}", daemon=True
        )
        self._thread.start()

    def take(self, step: int) -> None:
        """Snapshot this rank's pieces as of ``step`` without sending them, keeping the older
        snapshots: a restore that lost nobody (a replacement admitted) needs only own
        snapshots, and then loses no step. Nothing happens if the newest is of ``step``."""
        step = check_int("step", step, min=0, where="ShardMirror.take")
        if self.own and step <= self.own[-1].step:
            if step == self.own[-1].step:
                return
            raise ValueError(
                f"ShardMirror.take: step must grow, got {step} after {self.own[-1].step}"
            )
        self.settle()
        self.own = [*self.own, pack(step, self.kind, sections_of(self.optimizer, self.model))]

    def _run(self, *args: object) -> None:
        self._outcome = _exchange(*args)  # type: ignore[arg-type]

    def settle(self) -> BaseException | None:
        """Join the exchange in flight, keep the mirror if it arrived; return its error."""
        if self._thread is None:
            return None
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        out, self._outcome = self._outcome, _Exchange()
        self.stats.wait_s += time.perf_counter() - start
        self.stats.exchange_s += out.seconds
        self.stats.exchange_cpu_s += out.cpu_seconds
        if out.mirror is not None:
            self.mirrors = [*self.mirrors[-(KEEP - 1) :], out.mirror]
        return out.error

    def close(self) -> None:
        """The exchange is over (its group is about to be torn down): join the one in flight
        (what arrived is kept, its error is not raised), then cut the connections of the
        exchange group this mirror made. A peer still waiting on this rank's part (an
        exchange that failed here before sending it) then fails at once; without the cut,
        gloo would leave it waiting for the group's whole timeout. The snapshots stay."""
        self.settle()
        self._sockets.cut()

    def wait(self) -> None:
        """Join the exchange in flight; raise its error (a lost peer) on the training thread."""
        error = self.settle()
        if error is not None:
            raise error

    def own_at(self, step: int) -> Snapshot | None:
        """This rank's snapshot of ``step``, if it still holds one."""
        return next((s for s in self.own if s.step == step), None)

    def mirror_at(self, step: int) -> Snapshot | None:
        """The neighbour's snapshot of ``step``, if this rank holds one."""
        return next((s for s in self.mirrors if s.step == step), None)

    def held_bytes(self) -> int:
        """Bytes of snapshot buffers held now (own and mirrored; not the one in flight)."""
        return sum(s.nbytes for s in [*self.own, *self.mirrors])


def _zero_group(
    optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel | None
) -> dist.ProcessGroup | None:
    """The ZeRO group, after checking what the mirror was given."""
    where = "ShardMirror"
    if model is not None:
        check_instance(
            "model",
            model,
            FullyShardedDataParallel,
            "a FullyShardedDataParallel or None",
            where=where,
        )
        check_instance(
            "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim optimizer", where=where
        )
        return model.process_group
    check_instance(
        "optimizer",
        optimizer,
        ZeroRedundancyOptimizer,
        "a ZeroRedundancyOptimizer (or, with model=FullyShardedDataParallel, its optimizer)",
        where=where,
    )
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer.process_group
