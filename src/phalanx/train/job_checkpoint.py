"""``Job.save``, ``Job.resume`` and ``Job.track``: what a job checkpoints and how it picks up.

:class:`Checkpoints` takes the job's parts it needs, never the job: the training state
(:class:`.train_state.TrainState`: counters, scheduler, sampler, tracked objects, loss scale),
the resume point, the runner, whose model and optimizer are saved in its strategy's form, and
the :class:`.save_policy.SavePolicy` that says how a save runs.

Tracked objects follow Fabric's ``save(path, state)`` in naming each object (a name, not a
position as Accelerate's ``register_for_checkpointing`` has, so adding one does not shift the
others) and torch's ``Stateful`` protocol in what an object offers.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from phalanx._check import check_bool, check_str, fail
from phalanx.checkpoint import structure
from phalanx.train.resume_point import ResumePoint, SamplerState
from phalanx.train.save_policy import SavePolicy
from phalanx.train.strategies.base import Runner, Scheduler, Stateful
from phalanx.train.train_state import TrainState

__all__ = ["Checkpoints"]

log = logging.getLogger(__name__)


class Checkpoints:
    """One job's checkpoints.

    Args:
        directory: ``Job(checkpoint_dir=)`` (None: the job does not checkpoint).
        keep_last: Committed checkpoints to keep.
        state: The job's training state.
        point: The job's resume point.
        runner: The strategy at work, whose model and optimizer are saved.
        policy: How saves run (live recovery has its own).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        keep_last: int,
        state: TrainState,
        point: ResumePoint,
        runner: Runner,
        policy: SavePolicy,
    ) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.state, self.point, self.runner, self.policy = state, point, runner, policy
        self.saved_step: int | None = None
        """The step of the newest save started (committed, or being written)."""
        self.epoch_scheduler = False
        """The job steps its scheduler once per epoch (``setup(schedule="epoch")``): a resume
        at an epoch's end takes that epoch's scheduler step."""

    def track(self, name: object, obj: object) -> None:
        """Add ``obj`` to the tracked objects under ``name`` (:meth:`phalanx.Job.track`).

        ``obj`` is anything with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``
        protocol: a metric, an EMA of the weights, a data-loader state, a counter...) whose
        state is tensors and JSON-able values (nothing is pickled); rank 0's is saved and every
        rank loads it. Call it before ``job.epochs()``, which resumes. A live replacement may
        track an object after it received the job's state: the object's part loads then.

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
        if name in self.state.tracked:
            raise ValueError(f"Job.track(name={name!r}): an object is tracked as {name!r} already")
        received = self.policy.received(name)
        if self.state.resumed and received is None:
            raise ValueError(
                f"Job.track({name!r}, ...) after the job resumed (job.epochs() started): track "
                f"objects before the loop, so that resuming restores them"
            )
        self.state.tracked[name] = obj
        if received is not None:
            obj.load_state_dict(received)

    def save(self, async_: bool = True, **extra: object) -> Path:
        """Write a checkpoint of the model, optimizer, scheduler, tracked objects, sampler,
        RNG, step and the fp16 loss scale.

        By default (``async_=True``) it returns once the state is copied to host staging
        buffers and writes in the background (``checkpoint.save(async_=True)``): the next
        ``save``, ``job.close()``, a resume and the interpreter's exit wait for that write and
        raise (at exit: log) its error. ``async_=False`` writes and commits before returning.

        Call it anywhere between steps: after any ``step()``, mid-epoch or after an epoch's last
        batch, with accumulation micro-steps pending or not. A job resumed from it trains on
        bit-identically to the run that saved it (see :mod:`phalanx.train.resume_point`; with
        micro-steps pending it redoes them). ``extra`` values (JSON-able: numbers, strings,
        lists, dicts) come back in ``resumed_extra`` of the job that resumes.

        Returns:
            The committed checkpoint directory (with ``async_``: the one it will be committed
            as; the directory itself when the policy abandoned the save).
        """
        async_ = check_bool("async_", async_, where="Job.save")
        if self.directory is None:
            raise ValueError("Job.save() needs Job(checkpoint_dir=...)")
        structure.flatten(extra, "Job.save(...)", allow_tensors=False)  # names a bad value
        state, saves = self.state, self.policy
        for name, obj in state.tracked.items():  # storable, checked on every rank first
            structure.flatten(obj.state_dict(), f"Job.track({name!r}) state")
        from phalanx import checkpoint

        model, optimizer = self.runner.checkpointed(saving=True)
        point = saves.record(self.point, state)
        job_state = point.job_state()
        if state.scaler is not None:  # unchanged by pending micro-steps
            job_state["scaler"] = state.scaler.state_dict()
        saved: list[Path] = []

        def write() -> None:
            saved.append(
                checkpoint.save(
                    self.directory,  # type: ignore[arg-type]
                    state.step,
                    model=model,
                    optimizer=optimizer,
                    scheduler=state.scheduler,
                    sampler=None if point.sampler is None else SamplerState(point.sampler),
                    extra={"job": job_state, "values": extra, **saves.extra()},
                    keep_last=self.keep_last,
                    rng_state=point.rng,
                    objects=state.tracked,
                    async_=async_ and saves.background,
                    replicas_equal=self.runner.strategy.replicas_equal,
                )
            )

        if not saves.commit(write):
            return Path(self.directory)
        self.saved_step = state.step
        return saved[0]

    def commit_step(self) -> Path:
        """This step's checkpoint, committed before returning: written now, or the loop's own
        save of this step waited for (``Job``'s stop for SIGTERM)."""
        if self.saved_step == self.state.step and self.directory is not None:
            from phalanx import checkpoint
            from phalanx.checkpoint.catalog import latest

            return checkpoint.wait() or latest(self.directory) or Path(self.directory)
        return self.save(async_=False)

    def wait(self) -> None:
        """Wait for the job's checkpoint write in flight, if any, raising its error."""
        if self.directory is not None:
            from phalanx import checkpoint

            checkpoint.wait()

    def resume(self) -> int:
        """Load the newest committed checkpoint (if any) unless the job has its state
        already; return the epoch to start from.

        The job has its state after a first resume, and in a live replacement, which received
        it from a member: ``job.resume()`` then only returns the epoch.
        """
        if self.state.resumed:
            return self.state.epoch
        return self.load_newest()

    def load_newest(self) -> int:
        """Load the newest committed checkpoint (if any); return the epoch to start from.

        Afterwards ``state.resumed_extra`` holds the keyword values given to the ``save()``
        that wrote the checkpoint (``{}`` when there was none). A checkpoint loaded before the
        job's loader exists leaves its sampler position to the loader made next.
        """
        state = self.state
        state.resumed = True
        if self.directory is None:
            return state.epoch
        from phalanx import checkpoint

        model, optimizer = self.runner.checkpointed(saving=False)
        info = checkpoint.load(
            self.directory,
            model=model,
            optimizer=optimizer,
            scheduler=state.scheduler,
            sampler=state.sampler,
            objects=state.tracked,
        )
        if info is None:
            return state.epoch
        state.step = info.step
        job_state, values = _split(info.extra)
        state.resumed_extra = dict(values)
        self.policy.resumed(info.extra)
        where = str(info.path / "manifest.json")
        state.epoch = self.point.resumed(job_state, info.sampler, where)
        if self.epoch_scheduler and state.scheduler is not None and job_state.get("epoch_done"):
            _step_after_resume(state.scheduler)
        if state.scaler is not None and "scaler" in job_state:
            state.scaler.load_state_dict(job_state["scaler"])
        if self.runner.world.is_main:
            log.info("resumed from %s (step %d, epoch %d)", info.path, info.step, state.epoch)
        return state.epoch


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
