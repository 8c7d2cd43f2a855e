"""``Job.save``, ``Job.resume`` and ``Job.track``: what a job checkpoints and how it picks up.

Tracked objects follow Fabric's ``save(path, state)`` in naming each object (a name, not a
position as Accelerate's ``register_for_checkpointing`` has, so adding one does not shift the
others) and torch's ``Stateful`` protocol in what an object offers.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx._check import check_bool, check_str, fail
from phalanx.checkpoint import structure
from phalanx.train.resume_point import SamplerState
from phalanx.train.strategies.base import Scheduler, Stateful

if TYPE_CHECKING:  # the job calls these with itself; no import at run time
    from phalanx.train.job import Job

__all__ = ["resume", "save", "track", "wait"]

log = logging.getLogger(__name__)


def track(job: Job, name: object, obj: object) -> None:
    """Add ``obj`` to ``job.tracked`` under ``name`` (:meth:`phalanx.Job.track`).

    ``obj`` is anything with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``
    protocol: a metric, an EMA of the weights, a data-loader state, a counter...) whose state is
    tensors and JSON-able values (nothing is pickled); rank 0's is saved and every rank loads
    it. Call it before ``job.epochs()``, which resumes.

    Raises:
        TypeError: ``name`` is not a string, or ``obj`` lacks the two methods.
        ValueError: ``name`` is empty or tracked already, or the job has resumed already.
    """
    where = "Job.track"
    name = check_str("name", name, where=where)
    if not name:
        raise ValueError("Job.track(name=''): name must be a non-empty string")
    if not isinstance(obj, Stateful):  # a runtime-checkable protocol, as torch's
        what = "an object with state_dict() and load_state_dict()"
        raise fail("obj", obj, what, where=where, fix=f"tracking {name!r}", error=TypeError)
    if name in job.tracked:
        raise ValueError(f"Job.track(name={name!r}): an object is tracked as {name!r} already")
    # A live job's replacement received its state in setup(): what it tracks next loads it.
    pending = job.live is not None and name in job.live.held.tracked
    if job.state.resumed and not pending:
        raise ValueError(
            f"Job.track({name!r}, ...) after the job resumed (job.epochs() started): track "
            f"objects before the loop, so that resuming restores them"
        )
    job.tracked[name] = obj
    if pending:
        assert job.live is not None
        job.live.held.settle(job)


def _check_tracked(job: Job) -> None:
    """Every tracked object's state is storable, checked on every rank before any writes."""
    for name, obj in job.tracked.items():
        structure.flatten(obj.state_dict(), f"Job.track({name!r}) state")


def save(job: Job, async_: bool = True, **extra: object) -> Path:
    """Write a checkpoint of the model, optimizer, scheduler, tracked objects, sampler, RNG,
    step and the fp16 loss scale.

    By default (``async_=True``) it returns once the state is copied to host staging buffers
    and writes in the background (``checkpoint.save(async_=True)``): the next ``save``,
    ``job.close()`` and a resume wait for that write and raise its error. ``async_=False``
    writes and commits before returning.

    Call it anywhere between steps: after any ``step()``, mid-epoch or after an epoch's last
    batch, with accumulation micro-steps pending or not. A job resumed from it trains on
    bit-identically to the run that saved it (see :mod:`phalanx.train.resume_point`; with
    micro-steps pending it redoes them). ``extra`` values (JSON-able: numbers, strings, lists,
    dicts) come back in ``resumed_extra`` of the job that resumes.

    Returns:
        The committed checkpoint directory (with ``async_``: the one it will be committed as).
    """
    async_ = check_bool("async_", async_, where="Job.save")
    if job.checkpoint_dir is None:
        raise ValueError("Job.save() needs Job(checkpoint_dir=...)")
    structure.flatten(extra, "Job.save(...)", allow_tensors=False)  # names a bad value
    _check_tracked(job)
    from phalanx import checkpoint

    if job.live is not None:
        return _save_live(job, **extra)
    model, optimizer = job.runner.checkpointed(saving=True)
    point = job.resume_point.record(job.epoch)
    job_state = point.job_state()
    if job.precision.scaler is not None:  # unchanged by pending micro-steps
        job_state["scaler"] = job.precision.scaler.state_dict()
    return checkpoint.save(
        job.checkpoint_dir,
        job.step_count,
        model=model,
        optimizer=optimizer,
        scheduler=job.scheduler,
        sampler=None if point.sampler is None else SamplerState(point.sampler),
        extra={"job": job_state, "values": extra},
        keep_last=job.keep_last,
        rng_state=point.rng,
        objects=job.tracked,
        async_=async_,
        replicas_equal=job.runner.strategy.replicas_equal,
    )


def _save_live(job: Job, **extra: object) -> Path:
    """A live job's save: synchronous (a background write would outlive a lost member's
    group), the elastic sampler and the ledger in it, and abandoned if a member is lost
    meanwhile (the job goes on; the previous checkpoint stays the newest)."""
    from phalanx import checkpoint

    live, folder = job.live, Path(str(job.checkpoint_dir))
    assert live is not None and job.checkpoint_dir is not None
    if live.failed:
        log.warning("Job.save() after a failed step: nothing new to save (step %d)", job.step_count)
        return folder
    model, optimizer = job.runner.checkpointed(saving=True)
    sampler = job.sampler
    done = sampler is not None and sampler.epoch > job.epoch  # the epoch's last step committed
    state: dict[str, Any] = {"epoch": job.epoch, "epoch_done": done}
    ledger = None if live.ledger is None else live.ledger.to_dict()
    saved: list[Path] = []

    def write() -> None:
        saved.append(
            checkpoint.save(
                job.checkpoint_dir,  # type: ignore[arg-type]
                job.step_count,
                model=model,
                optimizer=optimizer,
                scheduler=job.scheduler,
                sampler=sampler,
                extra={"job": state, "values": extra, "ledger": ledger},
                keep_last=job.keep_last,
                objects=job.tracked,
                async_=False,
                replicas_equal=True,
            )
        )

    if not live.guard(job, write):
        log.warning("checkpoint of step %d abandoned: a member was lost in it", job.step_count)
        return folder
    return saved[0]


def wait(job: Job) -> None:
    """Wait for the job's checkpoint write in flight, if any, raising its error."""
    if job.checkpoint_dir is not None:
        from phalanx import checkpoint

        checkpoint.wait()


def resume(job: Job) -> int:
    """Load the newest committed checkpoint (if any); return the epoch to start from.

    Afterwards ``job.resumed_extra`` holds the keyword values given to the ``save()`` that
    wrote the checkpoint (``{}`` when there was none).
    """
    job.state.resumed = True
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
        objects=job.tracked,
    )
    if info is None:
        return 0
    job.step_count = info.step
    job_state, values = _split(info.extra)
    job.state.resumed_extra = dict(values)
    if job.live is not None:  # the elastic sampler was loaded; the ledger goes on
        job.live.resumed(info.extra.get("ledger"))
        job.epoch = int(job_state["epoch"]) + bool(job_state.get("epoch_done"))
    else:
        where = str(info.path / "manifest.json")
        job.epoch = job.resume_point.resumed(job_state, info.sampler, where)
    if job.schedule == "epoch" and job.scheduler is not None and job_state.get("epoch_done"):
        _step_after_resume(job.scheduler)
    if job.precision.scaler is not None and "scaler" in job_state:
        job.precision.scaler.load_state_dict(job_state["scaler"])
    if job.world.is_main:
        log.info("resumed from %s (step %d, epoch %d)", info.path, info.step, job.epoch)
    return job.epoch


def _step_after_resume(scheduler: Scheduler) -> None:
    """The epoch's scheduler step that followed the save (at the end of the epoch's loop body)
    in the saving run. Its optimizer did step before it there; torch cannot know that here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
        scheduler.step()


def _split(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's own fields and the user's values of a checkpoint's ``extra``."""
    if "job" in extra and "values" in extra:
        return extra["job"], extra["values"]
    # Written before the two were kept apart: the job's fields beside the user's values.
    job: dict[str, Any] = {k: extra[k] for k in ("epoch", "epoch_done") if k in extra}
    return job, {k: v for k, v in extra.items() if k not in job}
