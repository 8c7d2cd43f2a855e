"""``Job.save`` and ``Job.resume``: what a job checkpoints and how it picks up again."""

from __future__ import annotations

import logging
from typing import Any, cast

from phalanx.comm.group import World
from phalanx.sharding.state import Sharded

__all__ = ["CheckpointMixin"]

log = logging.getLogger(__name__)


class CheckpointMixin:
    """Checkpointing for :class:`phalanx.Job` (which sets every attribute declared here)."""

    checkpoint_dir: Any
    strategy: str
    parallel: Any
    model: Any
    optimizer: Any
    scheduler: Any
    sampler: Any
    step_count: int
    epoch: int
    keep_last: int
    world: World
    _resumed: bool

    def save(self, **extra: Any) -> Any:
        """Write a checkpoint of the model, optimizer, scheduler, sampler, RNG and step."""
        if self.checkpoint_dir is None:
            raise ValueError("Job.save() needs Job(checkpoint_dir=...)")
        from phalanx import checkpoint

        if self.strategy == "torch-fsdp":
            raise ValueError(
                "Job.save() does not checkpoint strategy='torch-fsdp' (a benchmark baseline whose "
                "parameters are DTensors); use strategy='zero3' for resumable sharded training"
            )
        consolidate = getattr(self.optimizer, "consolidate_state_dict", None)
        if consolidate is not None and not isinstance(self.optimizer, Sharded):
            consolidate(to=0)  # torch's ZeroRedundancyOptimizer gathers to rank 0 first
        model, optimizer = self._checkpointed()
        return checkpoint.save(
            self.checkpoint_dir,
            self.step_count,
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
            extra={"epoch": self.epoch, "epoch_done": self._epoch_done(), **extra},
            keep_last=self.keep_last,
        )

    def resume(self) -> int:
        """Load the newest committed checkpoint (if any); return the epoch to start from."""
        self._resumed = True
        if self.checkpoint_dir is None:
            return 0
        from phalanx import checkpoint

        model, optimizer = self._checkpointed()
        info = checkpoint.load(
            self.checkpoint_dir,
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
        )
        if info is None:
            return 0
        self.step_count = info.step
        self.epoch = int(info.extra["epoch"]) + (1 if info.extra.get("epoch_done") else 0)
        if self.world.is_main:
            log.info("resumed from %s (step %d, epoch %d)", info.path, info.step, self.epoch)
        return self.epoch

    def _checkpointed(self) -> tuple[Any, Any]:
        """The model and optimizer as checkpoints see them: split models as per-rank pieces."""
        views = getattr(self.model, "checkpoint_views", None)
        if self.parallel is not None and views is not None:
            return cast(tuple[Any, Any], views(self.optimizer))
        return self.model, self.optimizer

    def _epoch_done(self) -> bool:
        # Without a resumable position the epoch can only be redone whole: count it as done.
        position = getattr(self.sampler, "position", None)
        return position is None or position >= len(self.sampler)
