"""``Job.save`` and ``Job.resume``: what a job checkpoints and how it picks up again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the job calls these with itself; no import at run time
    from phalanx.train.job import Job

__all__ = ["resume", "save"]

log = logging.getLogger(__name__)


def save(job: Job, **extra: object) -> Path:
    """Write a checkpoint of the model, optimizer, scheduler, sampler, RNG and step."""
    if job.checkpoint_dir is None:
        raise ValueError("Job.save() needs Job(checkpoint_dir=...)")
    from phalanx import checkpoint

    model, optimizer = job.runner.checkpointed(saving=True)
    return checkpoint.save(
        job.checkpoint_dir,
        job.step_count,
        model=model,
        optimizer=optimizer,
        scheduler=job.scheduler,
        sampler=job.sampler,
        extra={"epoch": job.epoch, "epoch_done": _epoch_done(job), **extra},
        keep_last=job.keep_last,
    )


def resume(job: Job) -> int:
    """Load the newest committed checkpoint (if any); return the epoch to start from."""
    job._resumed = True
    if job.checkpoint_dir is None:
        return 0
    from phalanx import checkpoint

    model, optimizer = job.runner.checkpointed(saving=False)
    info = checkpoint.load(
        job.checkpoint_dir,
        model=model,
        optimizer=optimizer,
        scheduler=job.scheduler,
        sampler=job.sampler,
    )
    if info is None:
        return 0
    job.step_count = info.step
    job.epoch = int(info.extra["epoch"]) + (1 if info.extra.get("epoch_done") else 0)
    if job.world.is_main:
        log.info("resumed from %s (step %d, epoch %d)", info.path, info.step, job.epoch)
    return job.epoch


def _epoch_done(job: Job) -> bool:
    # Without a resumable position the epoch can only be redone whole: count it as done.
    sampler = job.sampler
    return sampler is None or sampler.position >= len(sampler)
