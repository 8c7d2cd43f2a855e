"""Per-phase timings of this rank, gathered every N steps, fed to the straggler detector.

The communication half of :mod:`.straggler_rule`. Every ``every`` steps each rank contributes its
last ``every`` steps' five numbers (compute per phase, then wait) to one all-gather on a side
gloo group of its own: it never orders against the training's collectives (so it can run
asynchronously), never touches an accelerator (no device synchronisation), and is not recorded
by the hang detector. A gather is started at the end of its window and collected at the end of
the first later step by which it has completed (``is_completed()``: no waiting; a few may be in
flight): the ranks never wait for each other here. The detector then sees every step of the
window, one by one, so a longer ``every`` makes the gathers rarer (cheaper) without coarsening
the statistic; a verdict comes ``every`` steps later at most, plus about one.

The side group gets the default group's timeout (torch's ``new_group`` default is 30 minutes),
and :meth:`StragglerMonitor.close` abandons the gathers still in flight: ranks may end after
different numbers of steps, so a gather may never be matched, and nothing waits for it. The
group is then kept alive (:data:`_ABANDONED`): the last reference to a gloo group blocks until
its work in flight ends, which an unmatched gather does only when the peers' side groups go
(their close, their exit) or the timeout passes. A process ends normally meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.group import DEFAULT_TIMEOUT
from phalanx.train.phases import PHASES
from phalanx.train.straggler_rule import StragglerDetector, StragglerFinding, StragglerRule

__all__ = ["StragglerMonitor"]

log = logging.getLogger(__name__)
# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); older torch has only it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MAX_IN_FLIGHT = 4
"""Gathers started and not yet collected; one more waits for the oldest."""
_ABANDONED: list[Any] = []
"""Side groups released with gathers in flight, kept referenced (see the module's notes)."""


class StragglerMonitor:
    """Sums this rank's per-phase times; every ``every`` steps compares ranks doing equal work.

    Collective to construct: every rank of the world makes its monitor at the same point.

    Args:
        every: Steps per window (>= 1).
        peers: Sets of global ranks doing the same work, compared among themselves (default:
            the whole world); sets of one rank are not compared.
        rule: The detector's margins and persistence.
    """

    def __init__(
        self,
        every: int,
        peers: Sequence[Sequence[int]] | None = None,
        rule: StragglerRule | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"straggler_check_every must be >= 1 (0 disables), got {every}")
        self.every = every
        self.world_size = dist.get_world_size()
        self.group: Any = dist.new_group(backend="gloo", timeout=job_timeout())
        sets = peers if peers is not None else [range(self.world_size)]
        self.detectors = [StragglerDetector(list(s), rule) for s in sets if len(s) >= 2]
        self.finding: StragglerFinding | None = None
        """The latest finding (kept after the rank recovers)."""
        self._rows: list[list[float]] = []
        self._pending: deque[tuple[Any, torch.Tensor]] = deque()

    def step(self, values: Sequence[float]) -> StragglerFinding | None:
        """Count one step's seconds (compute per compute phase, then wait).

        Returns a finding when the gathers collected now named a straggler.
        """
        self._rows.append(list(values))
        found = None
        if len(self._rows) >= self.every and self.group is not None:
            if len(self._pending) >= MAX_IN_FLIGHT:  # a peer far behind: wait for the oldest
                found = self._collect()
            mine = torch.tensor(self._rows, dtype=torch.float64).flatten()
            out = torch.empty(self.world_size * mine.numel(), dtype=torch.float64)
            self._pending.append((_all_gather_single(out, mine, self.group, True), out))
            self._rows = []
        while self._pending and self._pending[0][0].is_completed():
            found = self._collect() or found
        return found

    def _collect(self) -> StragglerFinding | None:
        """Wait for the oldest gather in flight and feed its steps to the detectors."""
        work, out = self._pending.popleft()
        try:
            work.wait()
        except RuntimeError as exc:  # a peer died: training's own collectives will say so
            log.warning(
                "rank %d: the straggler monitor's gather failed (%s); straggler detection is "
                "off for the rest of this job",
                dist.get_rank(),
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            self._release()
            return None
        steps = out.view(self.world_size, -1, len(PHASES)).transpose(0, 1).tolist()
        found = None
        for rows in steps:  # one step at a time, all ranks
            for detector in self.detectors:
                found = detector.observe([rows[r] for r in detector.ranks]) or found
        if found is not None:
            self.finding = found
        return found

    @property
    def current(self) -> StragglerFinding | None:
        """The finding that still stands out in the latest window, if any."""
        return next((d.current for d in self.detectors if d.current is not None), None)

    def close(self) -> None:
        """Release the side group, abandoning the gathers in flight (idempotent, never waits).

        Ranks may stop after different numbers of steps: a gather only some ranks started is
        never matched, and waiting for it would block until the timeout.
        """
        self._release()

    def _release(self) -> None:
        in_flight = any(not work.is_completed() for work, _ in self._pending)
        self._pending.clear()
        if self.group is not None:
            group, self.group = self.group, None
            dist.destroy_process_group(group)
            if in_flight:  # dropping the last reference would wait for the unmatched gathers
                _ABANDONED.append(group)


def job_timeout() -> timedelta:
    """The default group's collective timeout (phalanx's default if torch does not say)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", ()):
        with contextlib.suppress(AttributeError, RuntimeError):
            timeout = pg._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    return DEFAULT_TIMEOUT
