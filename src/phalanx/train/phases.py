"""Where a rank's step time goes: data, forward, backward, optimizer, and communication wait.

The job marks phase boundaries as the loop passes them (:meth:`PhaseClock.enter`); every moment
between two marks belongs to the phase the first one opened. At each mark the clock also reads
:func:`phalanx.comm.wait_clock.waited`, so the time this rank spent blocked on communication
*inside* a phase (a fast rank waiting in DDP's backward all-reduce, in ZeRO's parameter
all-gather at ``step()``, in a pipeline's receive) is counted as that phase's wait and taken out
of its compute. A phase's compute is therefore what the rank itself did, which is what tells a
slow rank from one that only waits for it.

Observers (:mod:`.observers`, e.g. the timeline recorder) are told every mark and relabel.

Marks cost two clock reads. On an accelerator the clock measures host time: kernels queued
asynchronously count where the host waits for them, not where they were launched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from phalanx.comm import wait_clock
from phalanx.train.observers import JobObserver

__all__ = ["COMPUTE_PHASES", "PHASES", "PhaseClock"]

COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")
"""The phases a rank spends computing (loading data counts as computing here)."""
PHASES = (*COMPUTE_PHASES, "communication")
"""Every phase a straggler can be slow in: the compute phases, then communication wait."""
_INDEX = {name: i for i, name in enumerate(COMPUTE_PHASES)}


class PhaseClock:
    """Accumulates, per compute phase, seconds of compute and of communication wait.

    Args:
        waited: Cumulative seconds of communication wait of this process (default: every wait
            site phalanx times, :func:`phalanx.comm.wait_clock.waited`).
        now: The clock (seconds).
    """

    def __init__(
        self,
        waited: Callable[[], float] = wait_clock.waited,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._waited, self._now = waited, now
        self.observers: list[JobObserver] = []
        """Told every mark (``phase``) and relabel, after the clock counted it."""
        self.phase: str | None = None
        """The open phase (None: not timing, e.g. between jobs or inside the monitor)."""
        self._start = self._wait_start = 0.0
        self.compute = [0.0] * len(COMPUTE_PHASES)
        """Seconds of compute per phase since the last :meth:`take`."""
        self.wait = [0.0] * len(COMPUTE_PHASES)
        """Seconds of communication wait per phase since the last :meth:`take`."""
        self.total_compute = [0.0] * len(COMPUTE_PHASES)
        """Seconds of compute per phase since the clock was made."""
        self.total_wait = [0.0] * len(COMPUTE_PHASES)
        """Seconds of communication wait per phase since the clock was made."""

    def enter(self, phase: str | None) -> None:
        """Close the open phase and open ``phase`` (None: stop timing until the next mark)."""
        if phase is not None and phase not in _INDEX:
            raise ValueError(f"phase must be one of {COMPUTE_PHASES} or None, got {phase!r}")
        now, waited = self._now(), self._waited()
        if self.phase is not None:
            i = _INDEX[self.phase]
            elapsed = now - self._start
            # Waits of other threads can overlap; a phase never waits longer than it lasted.
            wait = min(max(0.0, waited - self._wait_start), elapsed)
            self.compute[i] += elapsed - wait
            self.wait[i] += wait
            self.total_compute[i] += elapsed - wait
            self.total_wait[i] += wait
        self.phase, self._start, self._wait_start = phase, now, waited
        for observer in self.observers:
            observer.phase(phase)

    def relabel(self, phase: str) -> None:
        """Count the open stretch of time as ``phase`` (a boundary the loop never marked)."""
        if phase not in _INDEX:
            raise ValueError(f"phase must be one of {COMPUTE_PHASES}, got {phase!r}")
        if self.phase is not None:
            self.phase = phase
            for observer in self.observers:
                observer.relabel(phase)

    def take(self) -> list[float]:
        """Seconds since the last call: compute per phase, then the total wait; resets them."""
        values = [*self.compute, sum(self.wait)]
        self.compute = [0.0] * len(COMPUTE_PHASES)
        self.wait = [0.0] * len(COMPUTE_PHASES)
        return values

    def shares(self) -> dict[str, float]:
        """Each compute phase's and communication's share of the time the clock measured."""
        total = sum(self.total_compute) + sum(self.total_wait)
        if total <= 0:
            return {f"{p}_share": 0.0 for p in PHASES}
        out = {f"{p}_share": c / total for p, c in zip(COMPUTE_PHASES, self.total_compute)}
        out["communication_share"] = sum(self.total_wait) / total
        return out
