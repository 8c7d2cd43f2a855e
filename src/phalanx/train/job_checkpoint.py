"""``Job.save`` and ``Job.resume``: what a job checkpoints and how it picks up again."""

from __future__ import annotations

import logging
from typing import Any, cast

from phalanx.checkpoint import structure
from phalanx.comm.group import World
from phalanx.sharding.state import Sharded
from phalanx.train.precision import Precision
from phalanx.train.resume_point import ResumePoint, SamplerState

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
    precision: Precision
    _resumed: bool
    _resume_point: ResumePoint
    resumed_extra: dict[str, Any]

    def save(self, **extra: Any) -> Any:
        """Write a checkpoint of the model, optimizer, scheduler, sampler, RNG, step and the
        fp16 loss scale.

        Call it anywhere between steps: after any ``step()``, mid-epoch or after an epoch's
        last batch, with accumulation micro-steps pending or not. A job resumed from it trains
        on bit-identically to the run that saved it (see :mod:`phalanx.train.resume_point`;
        with micro-steps pending it redoes them). ``extra`` values (JSON-able: numbers,
        strings, lists, dicts) come back in :attr:`resumed_extra` of the job that resumes.

        Returns:
            The committed checkpoint directory.
        """
        if self.checkpoint_dir is None:
            raise ValueError("Job.save() needs Job(checkpoint_dir=...)")
        structure.flatten(extra, "Job.save(...)", allow_tensors=False)  # names a bad value
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
        point = self._resume_point.record(self.epoch)
        job_state = point.job_state()
        if self.precision.scaler is not None:  # unchanged by pending micro-steps
            job_state["scaler"] = self.precision.scaler.state_dict()
        return checkpoint.save(
            self.checkpoint_dir,
            self.step_count,
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            sampler=None if point.sampler is None else SamplerState(point.sampler),
            extra={"job": job_state, "values": extra},
            keep_last=self.keep_last,
            rng_state=point.rng,
        )

    def resume(self) -> int:
        """Load the newest committed checkpoint (if any); return the epoch to start from.

        :meth:`epochs` calls it. Afterwards :attr:`resumed_extra` holds the keyword values
        given to the ``save()`` that wrote the checkpoint (``{}`` when there was none).
        """
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
        job_state, self.resumed_extra = _split(info.extra)
        where = str(info.path / "manifest.json")
        self.epoch = self._resume_point.resumed(job_state, where)
        if self.precision.scaler is not None and "scaler" in job_state:
            self.precision.scaler.load_state_dict(job_state["scaler"])
        if self.world.is_main:
            log.info("resumed from %s (step %d, epoch %d)", info.path, info.step, self.epoch)
        return self.epoch

    def _checkpointed(self) -> tuple[Any, Any]:
        """The model and optimizer as checkpoints see them: split models as per-rank pieces."""
        views = getattr(self.model, "checkpoint_views", None)
        if self.parallel is not None and views is not None:
            return cast(tuple[Any, Any], views(self.optimizer))
        return self.model, self.optimizer


def _split(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's own fields and the user's values of a checkpoint's ``extra``."""
    if "job" in extra and "values" in extra:
        return extra["job"], extra["values"]
    # Written before the two were kept apart: the job's fields beside the user's values.
    job: dict[str, Any] = {k: extra[k] for k in ("epoch", "epoch_done") if k in extra}
    return job, {k: v for k, v in extra.items() if k not in job}
