"""The phase clock and the straggler monitor of :class:`phalanx.Job`.

The job marks where its loop is: ``progress()`` resuming the loader opens "data", handing out
the batch opens "forward", ``backward()`` opens "backward" and then "optimizer", ``step()``
closes the step. A pipeline marks forward and backward per action of its schedule. From these
marks (:mod:`.phases`) come ``summary()``'s shares and, every ``straggler_check_every`` steps,
the straggler monitor's report (:mod:`.straggler_monitor`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from phalanx.comm import wait_clock
from phalanx.comm.group import World
from phalanx.mesh.groups import ParallelGroups
from phalanx.train.metrics import MetricsLogger
from phalanx.train.phases import PHASES, PhaseClock
from phalanx.train.ps_strategies import PSConfig
from phalanx.train.straggler_monitor import StragglerMonitor
from phalanx.train.stragglers import StragglerFinding, StragglerRule

__all__ = ["PhaseMixin"]

log = logging.getLogger(__name__)


class PhaseMixin:
    """Phase marks, ``summary()``'s shares and straggler findings for :class:`phalanx.Job`."""

    world: World
    model: nn.Module | None
    metrics: MetricsLogger
    step_count: int
    ps_config: PSConfig | None
    groups: ParallelGroups | None

    def _init_phases(self, check_every: int, rule: StragglerRule | None) -> None:
        """Start the clock; make the monitor (collective: every rank calls this in turn)."""
        wait_clock.claim()  # the job's thread trains: its waits are the communication wait
        self.phases = PhaseClock()
        """This rank's time per phase (see :mod:`phalanx.train.phases`)."""
        self._monitor: StragglerMonitor | None = None
        self._batch_given = False
        # Parameter-server workers are not in step: a collective among them would re-couple
        # them, so they are not compared.
        if not check_every or self.world.world_size < 2 or self.ps_config is not None:
            return
        peers = self._peer_sets()
        if peers is not None and all(len(p) < 2 for p in peers):
            log.info(
                "straggler detection is off: pipeline stages do different work, and with dp=1 "
                "no two ranks run the same stage"
            )
            return
        self._monitor = StragglerMonitor(check_every, peers, rule)

    def _peer_sets(self) -> list[list[int]] | None:
        """Ranks doing the same work: with a pipeline, the ranks of each stage; else all."""
        if self.groups is None or self.groups.topology.pp == 1:
            return None
        topology, stages = self.groups.topology, dict[int, list[int]]()
        for r in range(topology.world_size):
            stages.setdefault(topology.coords(r)["pp"], []).append(r)
        return list(stages.values())

    def _attach_phases(self) -> None:
        """Let a pipeline mark forward and backward per action of its schedule."""
        pipeline: Any = getattr(self.model, "module", None)
        if getattr(self.model, "pipelined", False) and hasattr(pipeline, "on_action"):
            pipeline.on_action = self.phases.enter

    def _mark_batch(self) -> None:
        """``progress()`` hands out a batch: forward starts."""
        self._batch_given = True
        self.phases.enter("forward")

    def _mark_backward(self) -> None:
        if self.phases.phase == "data" and not self._batch_given:
            self.phases.relabel("forward")  # no progress(): loading and forward are one stretch
        self.phases.enter("backward")

    def _end_step(self) -> None:
        """The optimizer stepped: close the step, feed the monitor, open the next "data"."""
        self.phases.enter(None)
        values = self.phases.take()
        self._batch_given = False
        if self._monitor is not None:
            found = self._monitor.step(values)
            if found is not None and self.world.rank == 0:
                self._report(found)
        self.phases.enter("data")

    def _report(self, found: StragglerFinding) -> None:
        log.warning("straggler: %s", found.describe())
        self.metrics.log_local(
            self.step_count,
            straggler_rank=found.rank,
            straggler_phase=PHASES.index(found.phase),
            straggler_excess_ms=1e3 * found.excess,
            straggler_factor=found.factor,
        )

    @property
    def straggler_finding(self) -> StragglerFinding | None:
        """The latest rank (and phase) found consistently slower than the others; every rank
        knows it. ``finding.phase`` is one of ``phalanx.train.phases.PHASES``."""
        return None if self._monitor is None else self._monitor.finding

    def phase_shares(self) -> dict[str, float]:
        """Each phase's share of this rank's measured time (``data_share``, ...,
        ``communication_share``): compute phases exclude the communication waited inside them."""
        return self.phases.shares()

    def _close_phases(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
