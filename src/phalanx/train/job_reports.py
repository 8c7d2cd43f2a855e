"""What a :class:`phalanx.Job` reports: its time per phase, stragglers, its strategy's groups.

Read-only views over the job's parts (the runner, the phase clock, the timer), kept apart from
the training loop in ``job.py``; ``Job`` inherits them.
"""

from __future__ import annotations

from phalanx.mesh.groups import ParallelGroups
from phalanx.parameter_server import ServerReport
from phalanx.train.job_phases import JobPhases
from phalanx.train.loop_helpers import Timer
from phalanx.train.phases import PhaseClock
from phalanx.train.straggler_rule import StragglerFinding
from phalanx.train.strategies import Runner

__all__ = ["JobReports"]


class JobReports:
    """The reporting half of :class:`phalanx.Job` (which sets these attributes)."""

    runner: Runner
    timing: JobPhases
    throughput: Timer

    def summary(self) -> dict[str, float]:
        """Samples/s over the job, this rank's seconds waiting for communication
        (``comm_wait_seconds``) and their share of its time (``comm_share``; :meth:`phase_shares`
        has each phase's). Both are NaN where the strategy's wait is not measured, never a
        silent 0."""
        times = self.throughput.summary(self.runner.world.world_size)
        return {**times, **self.timing.comm_summary(self.runner.comm_measured)}

    def phase_shares(self) -> dict[str, float]:
        """Each phase's share of this rank's measured time (``data_share``, ...,
        ``communication_share``): compute phases exclude the communication waited inside them."""
        return self.timing.shares()

    @property
    def phases(self) -> PhaseClock:
        """This rank's time per phase (see :mod:`phalanx.train.phases`)."""
        return self.timing.clock

    @property
    def straggler_finding(self) -> StragglerFinding | None:
        """The latest rank (and phase) found consistently slower than the others; every rank
        knows it. ``finding.phase`` is one of ``phalanx.train.phases.PHASES``."""
        return self.timing.finding

    @property
    def groups(self) -> ParallelGroups | None:
        """Process groups along dp / pp / tp of a ``phalanx.Mesh`` (None for others)."""
        return self.runner.groups

    @property
    def is_server(self) -> bool:
        """True on a parameter-server rank (which serves instead of training)."""
        return self.runner.role.is_server

    @property
    def server_report(self) -> ServerReport | None:
        """What this parameter server did (server ranks, once served); None elsewhere."""
        return self.runner.role.report
