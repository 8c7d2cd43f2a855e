"""Record one rank's timeline cheaply: appends while it trains, one file write per chunk.

A :class:`TimelineRecorder` keeps four lists, each filled by an append on the thread where the
event happens:

- the phase marks of the job's loop (it is a job observer, :mod:`phalanx.train.observers`):
  ``(time, phase)``, and ``(time, step)`` when a step ends;
- every flight record (:func:`phalanx.diagnostics.tracking.add_record_sink`): the
  :class:`~phalanx.diagnostics.flight.Record` object itself, whose ``end`` the operation fills in
  when it completes;
- every wait of the training thread (:func:`phalanx.comm.wait_clock.add_watcher`):
  ``(end, seconds)``.

Nothing touches the disk until :meth:`TimelineRecorder.flush`: at each checkpoint the job saves,
when the lists pass :data:`FLUSH_EVERY` entries (at a step's end), and at :meth:`close` (or at
exit, for a program that never closes its job). An operation still in flight at a flush waits
for the next one. The clock is measured against rank 0's when the recorder starts, at every
checkpoint and every ``sync_every`` steps (:mod:`.clock_sync`) — collectives of the default
group, so only where every rank steps and saves together (``lockstep``).

Without a job, drive it by hand: ``rec = TimelineRecorder("tl", rank=r, world_size=n)``,
``rec.start()``, ``rec.sync_clock()`` on every rank, ``rec.phase("forward")`` ...,
``rec.stepped(k)``, ``rec.close()``.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from typing import Any

import torch

from phalanx.comm import wait_clock
from phalanx.diagnostics import clock_sync, tracking
from phalanx.diagnostics.clock_math import ClockSample
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.rank_log import RankLogWriter, rank_path

__all__ = ["FLUSH_EVERY", "TimelineRecorder"]

FLUSH_EVERY = 200_000
"""Entries buffered before a step's end writes them (about 30 MB of memory at most)."""
CARRY_S = 60.0
"""An operation still in flight at a flush is written with the next chunk, unless it started
this long ago (an asynchronous work nobody waited for: it stays without an end)."""


class TimelineRecorder:
    """Records this rank's timeline into ``directory/rank<r>.timeline.jsonl``.

    Args:
        directory: The run's timeline folder (shared by every rank, or one per host).
        rank: This rank.
        world_size: Ranks in the job.
        device: Where the clock measurement's buffers live (the backend's device).
        sync_rounds: Ping-pongs per rank per clock measurement.
        sync_every: Steps between clock measurements (0: at start and checkpoints only).
        lockstep: Every rank steps and saves together: measure clocks then (else only when
            :meth:`sync_clock` is called).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        sync_rounds: int = 16,
        sync_every: int = 500,
        lockstep: bool = True,
    ) -> None:
        if sync_rounds < 1 or sync_every < 0:
            raise ValueError(
                f"TimelineRecorder: sync_rounds must be >= 1 and sync_every >= 0, got "
                f"sync_rounds={sync_rounds}, sync_every={sync_every}"
            )
        self.rank, self.world_size, self.device = rank, world_size, device
        self.sync_rounds, self.sync_every, self.lockstep = sync_rounds, sync_every, lockstep
        self.path = rank_path(directory, rank)
        """This rank's file."""
        header = {
            "rank": rank,
            "world_size": world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
        }
        self._writer = RankLogWriter(self.path, header)
        self._marks: list[tuple[float, str | None]] = []
        self._steps: list[tuple[float, int]] = []
        self._waits: list[tuple[float, float]] = []
        self._ops: list[Record] = []
        self._carried: list[Record] = []
        self.recording = False
        """Events are being recorded (:meth:`start`; :meth:`pause` stops)."""
        self.samples: list[ClockSample] = []
        """This rank's clock measurements so far."""
        self._closed = False
        atexit.register(self.close)

    # ---- switching on and off -----------------------------------------------------------------
    def start(self) -> None:
        """Begin (or resume) recording."""
        if not self.recording and not self._closed:
            tracking.add_record_sink(self.add_op)
            wait_clock.add_watcher(self.add_wait)
            self.recording = True

    def pause(self) -> None:
        """Stop recording until :meth:`start` (nothing buffered is lost)."""
        if self.recording:
            tracking.remove_record_sink(self.add_op)
            wait_clock.remove_watcher(self.add_wait)
            self.recording = False

    def add_op(self, rec: Record) -> None:
        """A flight record started (the record sink: an append)."""
        self._ops.append(rec)

    def add_wait(self, seconds: float) -> None:
        """The training thread waited ``seconds`` until now (the wait watcher: an append)."""
        self._waits.append((time.time(), seconds))

    # ---- the job observer (phalanx.train.observers) -------------------------------------------
    def phase(self, name: str | None) -> None:
        """The loop entered phase ``name`` (None: it stopped timing)."""
        if self.recording:
            self._marks.append((time.time(), name))

    def relabel(self, name: str) -> None:
        """The stretch the last mark opened counts as ``name``."""
        if self.recording:
            self._marks.append((time.time(), "~" + name))

    def loss(self, value: torch.Tensor) -> None:
        """A loss went backward: the timeline has it as the "backward" mark already."""

    def stepping(self, step: int) -> None:
        """The optimizer is about to step: the "optimizer" mark has it already."""

    def stepped(self, step: int) -> None:
        """Step ``step`` (the step count reached) is done."""
        if not self.recording:
            return
        self._steps.append((time.time(), step))
        if self.lockstep and self.sync_every and step % self.sync_every == 0:
            self.sync_clock()
        if len(self._ops) + len(self._marks) + len(self._waits) > FLUSH_EVERY:
            self.flush()

    def saved(self, step: int) -> None:
        """A checkpoint was saved: measure the clock (lockstep jobs) and write what is buffered."""
        if self.recording and self.lockstep:
            self.sync_clock()
        self.flush()

    def close(self) -> None:
        """Write everything, stop recording and close the file (idempotent)."""
        if self._closed:
            return
        self.pause()
        self.flush(final=True)
        self._writer.write("close", at=time.time())
        self._writer.close()
        self._closed = True
        atexit.unregister(self.close)

    # ---- clock and disk -----------------------------------------------------------------------
    def sync_clock(self) -> ClockSample:
        """Measure this rank's clock against rank 0's (a collective of the default group)."""
        sample = clock_sync.measure(self.sync_rounds, self.device)
        self.samples.append(sample)
        self._writer.write("sync", at=sample.at, offset=sample.offset, rtt=sample.rtt)
        return sample

    def flush(self, final: bool = False) -> None:
        """Write what was recorded since the last flush as one line of the rank's file."""
        marks, self._marks = self._marks, []
        steps, self._steps = self._steps, []
        waits, self._waits = self._waits, []
        ops, self._ops = self._ops, []
        ops = self._carried + ops
        now = time.time()
        later = [not final and r.end is None and now - r.start <= CARRY_S for r in ops]
        self._carried = [r for r, wait in zip(ops, later) if wait]
        done = [r for r, wait in zip(ops, later) if not wait]
        if marks or steps or waits or done:
            self._writer.write(
                "events",
                marks=marks,
                steps=steps,
                waits=waits,
                ops=[_row(r) for r in done],
            )


def _row(r: Record) -> list[Any]:
    return [r.group, r.seq, r.op, r.shape, r.args, r.site, r.start, r.end, r.peer, r.idle]
