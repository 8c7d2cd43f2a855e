"""How a job's checkpoints run: what they record, when they commit, what they carry besides.

``Job.save`` and ``Job.resume`` (:mod:`.job_checkpoint`) write and read the same files for every
job; a :class:`SavePolicy` is the part that differs. The default writes in the background and
records the resume point of :mod:`.resume_point`. Live recovery's policy
(:mod:`.live_runner`) writes in line, guarded against a member lost meanwhile, and carries the
sample ledger. ``job_start.Start.saves()`` picks the job's; ``Checkpoints.policy`` holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.train.resume_point import Record, ResumePoint
from phalanx.train.train_state import TrainState

__all__ = ["SavePolicy"]


class SavePolicy:
    """The default: background writes of the resume point, nothing else carried."""

    background = True
    """``Job.save()`` may write in the background (``async_=True``)."""
    preemptible = True
    """A SIGTERM may stop the job at an agreed step (:mod:`.preemption`)."""

    def record(self, point: ResumePoint, state: TrainState) -> Record:
        """The resume point a save records now."""
        return point.record(state.epoch)

    def commit(self, write: Callable[[], object]) -> bool:
        """Run ``write`` (the save); False when it was abandoned (the job goes on, the previous
        checkpoint stays the newest)."""
        write()
        return True

    def extra(self) -> dict[str, Any]:
        """JSON-able fields saved in the checkpoint's ``extra`` beside the job's own."""
        return {}

    def resumed(self, extra: dict[str, Any]) -> None:
        """A checkpoint with :meth:`extra`'s fields was loaded."""

    def received(self, name: str) -> dict[str, Any] | None:
        """A state for the tracked object ``name`` that arrived before it was tracked (a live
        replacement's), taken once; None when there is none."""
        return None
