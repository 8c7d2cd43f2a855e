"""The phase clock and the straggler monitor of :class:`phalanx.Job`.

The job marks where its loop is: ``progress()`` resuming the loader opens "data", handing out
the batch opens "forward", ``backward()`` opens "backward" and then "optimizer", ``step()``
closes the step. A pipeline marks forward and backward per action of its schedule. From these
marks (:mod:`.phases`) come ``summary()``'s shares and, every ``straggler_check_every`` steps,
the straggler monitor's report (:mod:`.straggler_monitor`). Observers (:mod:`.observers`: the
timeline recorder) are told each mark, each step and each save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from phalanx.comm import wait_clock
from phalanx.comm.group import World
from phalanx.train.metrics import MetricsLogger
from phalanx.train.observers import JobObserver
from phalanx.train.phases import PHASES, PhaseClock
from phalanx.train.straggler_monitor import StragglerMonitor
from phalanx.train.straggler_rule import StragglerFinding, StragglerRule

__all__ = ["JobPhases"]

log = logging.getLogger(__name__)


class JobPhases:
    """Phase marks, ``summary()``'s shares and straggler findings of one job.

    Making it makes the monitor (collective: every rank calls this in turn).

    Args:
        world: This process's place in the job.
        check_every: Steps between the monitor's gathers (0: no monitor).
        rule: The detector's margins and persistence.
        peers: Ranks doing the same work (None: all; an empty list: compare none).
        observers: Told every mark, step, save and the close (:mod:`.observers`).
    """

    def __init__(
        self,
        world: World,
        check_every: int,
        rule: StragglerRule | None,
        peers: Iterable[list[int]] | None,
        observers: Iterable[JobObserver] = (),
    ) -> None:
        wait_clock.claim()  # the job's thread trains: its waits are the communication wait
        self.world = world
        self.clock = PhaseClock()
        """This rank's time per phase (see :mod:`phalanx.train.phases`)."""
        self.observers = self.clock.observers
        """The job's observers (the clock tells them its marks; this object the rest)."""
        self.observers.extend(observers)
        self.monitor: StragglerMonitor | None = None
        self._batch_given = False
        sets = None if peers is None else list(peers)
        if not check_every or world.world_size < 2 or sets == []:
            return
        if sets is not None and all(len(p) < 2 for p in sets):
            log.info(
                "straggler detection is off: pipeline stages do different work, and with dp=1 "
                "no two ranks run the same stage"
            )
            return
        self.monitor = StragglerMonitor(check_every, sets, rule)

    def enter(self, phase: str | None) -> None:
        """Open ``phase`` (None: stop timing until the next mark)."""
        self.clock.enter(phase)

    def mark_batch(self) -> None:
        """``progress()`` hands out a batch: forward starts."""
        self._batch_given = True
        self.clock.enter("forward")

    def mark_backward(self) -> None:
        if self.clock.phase == "data" and not self._batch_given:
            self.clock.relabel("forward")  # no progress(): loading and forward are one stretch
        self.clock.enter("backward")

    def loss(self, value: torch.Tensor) -> None:
        """``backward(value)`` was called: tell the observers."""
        for observer in self.observers:
            observer.loss(value)

    def stepping(self, step: int) -> None:
        """The optimizer is about to make step ``step``: tell the observers."""
        for observer in self.observers:
            observer.stepping(step)

    def end_step(self, step: int, metrics: MetricsLogger) -> None:
        """The optimizer stepped: close the step, feed the monitor, open the next "data"."""
        self.clock.enter(None)
        for observer in self.observers:
            observer.stepped(step)
        values = self.clock.take()
        self._batch_given = False
        if self.monitor is not None:
            found = self.monitor.step(values)
            if found is not None and self.world.rank == 0:
                self._report(found, step, metrics)
        self.clock.enter("data")

    def _report(self, found: StragglerFinding, step: int, metrics: MetricsLogger) -> None:
        log.warning("straggler: %s", found.describe())
        metrics.log_local(
            step,
            straggler_rank=found.rank,
            straggler_phase=PHASES.index(found.phase),
            straggler_excess_ms=1e3 * found.excess,
            straggler_factor=found.factor,
        )

    @property
    def finding(self) -> StragglerFinding | None:
        """The latest rank (and phase) found consistently slower than the others."""
        return None if self.monitor is None else self.monitor.finding

    def shares(self) -> dict[str, float]:
        """Each phase's share of this rank's measured time."""
        return self.clock.shares()

    def comm_summary(self, measured: bool) -> dict[str, float]:
        """``comm_share`` and ``comm_wait_seconds``: NaN where the wait is not ``measured``."""
        if not measured:
            return {"comm_share": float("nan"), "comm_wait_seconds": float("nan")}
        share = self.shares()["communication_share"]
        return {"comm_share": share, "comm_wait_seconds": sum(self.clock.total_wait)}

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was saved (on every rank of a lockstep job)."""
        for observer in self.observers:
            observer.saved(step)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        for observer in self.observers:
            observer.close()
