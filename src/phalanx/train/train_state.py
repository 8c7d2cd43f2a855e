"""Where a :class:`phalanx.Job` is in its training: the one record its parts read and move.

``Job.step()``, ``Job.epochs()``, the job's loaders (:mod:`.resume_point`), checkpoints and the
live exchange all read and write this record, passed to them as an argument, instead of fields of
the job: it is the job's place in training, apart from the objects it trains (model, optimizer,
scheduler, tracked objects) and from how it trains them (the strategy's runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """The job's counters and loop flags (``job.state``)."""

    step: int = 0
    """Optimizer steps taken (restored on resume): ``job.step_count``."""
    epoch: int = 0
    """The epoch in training: ``job.epoch``. ``Job.epochs()`` sets it; without it, the job's
    loader moves to the next epoch when it is iterated again after handing out every sample
    of this one."""
    epochs_driven: bool = False
    """``Job.epochs()`` sets the epochs. A loader iterated twice in one of its epochs then
    repeats that epoch's order (as torch's ``set_epoch`` does) instead of moving on."""
    micro: int = 0
    """Micro-steps done in the open accumulation window (0: none pending)."""
    last_batch: bool = False
    """The batch in training is the epoch's last (it closes the accumulation window)."""
    resumed: bool = False
    """The job has picked up its state (from a checkpoint, or from a live member): objects
    tracked from now on would miss it."""
    resumed_extra: dict[str, object] = field(default_factory=dict)
    """The keyword values given to the ``save()`` the job resumed from."""

    def syncs_now(self, grad_accum: int) -> bool:
        """Whether the coming backward closes an accumulation window (gradients sync)."""
        return self.micro + 1 >= grad_accum or self.last_batch
