"""Per-step timings of this rank, gathered every N steps, fed to the straggler detector.

The communication half of :mod:`.stragglers`: one all-gather of two float64 numbers per rank
every ``every`` steps (a few microseconds of a step), on the group the job trains over.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from phalanx.comm.collectives import all_gather_into_tensor
from phalanx.train.stragglers import StragglerDetector, StragglerFinding

__all__ = ["StragglerMonitor"]


class StragglerMonitor:
    """Accumulates this rank's compute and wait time; every ``every`` steps compares ranks.

    Args:
        every: Steps between comparisons (>= 1).
        group: The ranks to compare (default: the world).
        threshold, patience: See :class:`StragglerDetector`.
    """

    def __init__(
        self,
        every: int,
        group: dist.ProcessGroup | None = None,
        *,
        threshold: float = 1.2,
        patience: int = 2,
    ) -> None:
        if every < 1:
            raise ValueError(f"straggler_check_every must be >= 1 (0 disables), got {every}")
        self.every, self.group = every, group
        self.detector = StragglerDetector(dist.get_world_size(group), threshold, patience)
        self.finding: StragglerFinding | None = None
        self._last = time.perf_counter()
        self._compute = self._wait = 0.0
        self._wait_total: float | None = None
        self._steps = 0

    def step(self, wait_total: float) -> StragglerFinding | None:
        """Count one step; ``wait_total`` is this rank's cumulative seconds in collectives.

        Returns the finding when this step's comparison named a straggler.
        """
        now = time.perf_counter()
        before = wait_total if self._wait_total is None else self._wait_total
        wait = max(0.0, wait_total - before)
        self._wait_total = wait_total
        self._compute += max(0.0, now - self._last - wait)
        self._wait += wait
        self._last = now
        self._steps += 1
        if self._steps < self.every:
            return None
        mine = torch.tensor([self._compute, self._wait], dtype=torch.float64) / self._steps
        gathered = torch.empty(2 * self.detector.world_size, dtype=torch.float64)
        all_gather_into_tensor(gathered, mine, group=self.group)
        per_rank = gathered.view(-1, 2)
        self._compute = self._wait = 0.0
        self._steps = 0
        self._last = time.perf_counter()  # the gather is not anyone's compute
        found = self.detector.observe(per_rank[:, 0].tolist(), per_rank[:, 1].tolist())
        if found is not None:
            self.finding = found
        return found
