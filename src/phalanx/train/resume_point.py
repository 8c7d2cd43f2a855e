"""Where a resumed job picks up: the moment of its last optimizer step, recorded whole.

A checkpoint holds the model and optimizer as the last optimizer step left them, so everything
else it records must describe that same moment, or the resumed run trains a batch twice, skips
one, or draws other dropout masks:

- **The sampler position** counts the samples whose gradients are in the weights. It advances
  when the job's loader hands a batch to the loop (:class:`ResumableLoader`), so a ``save()``
  after ``step()`` counts the batch just trained, and one after the last batch ends the epoch,
  whether the loop runs through ``job.progress(loader)`` or over ``loader`` itself. Every rank
  is at the same position, so a job resumed at another world size goes on from the samples all
  ranks consumed (``DistributedSampler.load_state_dict``: the rest of the epoch is dealt over
  the new ranks).
- **Batches not yet in the weights** (micro-steps pending: ``step()`` returned False; or a batch
  fetched and not trained) are not in the checkpoint (accumulated gradients are not saved): the
  resume point is then before the first of them, whose position and generator states were
  snapshotted before it was fetched (one snapshot per optimizer step: 72 µs on a 2-core EPYC,
  mostly numpy's state), and the resumed run redoes those batches with the same random draws.
- **The random generators** go back where the saving run had them for its next batch. A save
  taken inside an epoch replays them when the resumed loader fetches its first batch: after the
  new DataLoader iterator drew its worker seed from torch's generator (the saving run's iterator
  drew its seed before the save), before the fetch (in-process augmentation) and the forward
  (dropout). A save between epochs restores them at once, before the next epoch's iterator.

**Which epoch a loader reads** is the job's (:class:`.train_state.TrainState`), not the
sampler's, so a loader made inside the epoch loop is as good as one made before it: a new loader
takes over the job's position (:meth:`ResumePoint.follow`: the previous loader's sampler, or the
state a resume loaded before any loader existed), and each iteration first moves the sampler to
the job's epoch (:meth:`ResumePoint.align`). Without ``Job.epochs()`` (a plain ``range``), a
loader iterated again after handing out its whole epoch moves the job to the next epoch.

Not restored: random draws inside DataLoader worker processes (their seeds come from the
iterator, which a mid-epoch resume creates anew), and anything random the loop does between
``save()`` and its next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.checkpoint import rng
from phalanx.data.sampler import DistributedSampler
from phalanx.train.train_state import TrainState

__all__ = ["NO_HOOKS", "LoopHooks", "Record", "ResumableLoader", "ResumePoint", "SamplerState"]

REPLAY_AT_BATCH, REPLAY_NOW = "next-batch", "now"
"""When a resumed job restores the saved generator states (the ``rng_at`` of a record)."""


@dataclass(frozen=True)
class _Mark:
    """The sampler and generators before the first micro-batch of an accumulation window."""

    sampler: dict[str, Any]
    generators: rng.Snapshot


@dataclass(frozen=True)
class Record:
    """What ``Job.save()`` writes besides the model, optimizer and scheduler."""

    epoch: int
    """The epoch the resume point lies in."""
    epoch_done: bool
    """Every sample of that epoch is trained: a resumed job starts the next one."""
    sampler: dict[str, Any] | None
    """The sampler's ``state_dict()`` at the resume point (None without ``job.loader``)."""
    rng: dict[str, Any]
    """This rank's generator states at the resume point (``rng.capture()``'s form)."""
    rng_at: str
    """:data:`REPLAY_AT_BATCH` or :data:`REPLAY_NOW`."""

    def job_state(self) -> dict[str, Any]:
        """The JSON-able fields a resumed job reads back (see :meth:`ResumePoint.resumed`)."""
        return {"epoch": self.epoch, "epoch_done": self.epoch_done, "rng_at": self.rng_at}


class SamplerState:
    """A saved sampler state standing in for the sampler in ``checkpoint.save(sampler=...)``."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


@dataclass(frozen=True)
class LoopHooks:
    """What the job does around its loader's batches, whoever iterates the loader."""

    started: Callable[[], None]
    """A pass over the loader begins."""
    batch: Callable[[bool, int], bool]
    """A batch of ``n`` samples is about to be handed out (``last``: it ends the epoch);
    False stops the pass (a parameter server said so)."""
    ended: Callable[[], None]
    """The pass ended: run out, stopped, or left by the loop (``break``)."""


NO_HOOKS = LoopHooks(lambda: None, lambda last, n: True, lambda: None)


class ResumePoint:
    """Follows the job's loader and optimizer steps; records and restores the resume point.

    Args:
        state: The job's training state (its epoch, moved here by the loader as described
            above).
        hooks: The job's own work around each batch (:class:`LoopHooks`).
    """

    def __init__(self, state: TrainState, hooks: LoopHooks = NO_HOOKS) -> None:
        self.state = state
        self.hooks = hooks
        self.sampler: DistributedSampler | None = None
        """The sampler of the job's loader, whose position the checkpoint records."""
        self._loaded: dict[str, Any] | None = None  # resumed before any loader existed
        self._open = False  # a batch was handed out since the last optimizer step
        self._mark: _Mark | None = None  # the sampler and generators before that batch
        self._started_epoch: int | None = None
        self._replay: rng.Snapshot | None = None
        self._given_epoch: int | None = None  # the epoch align() last gave the sampler

    def follow(self, sampler: DistributedSampler) -> None:
        """``job.loader()`` made ``sampler`` the job's: it takes over the position of the
        previous one (or the one a resume loaded), which is the position saved from now on.

        Raises:
            ValueError: naming both sizes, when the new loader reads a dataset of another size
                than the job's (an evaluation loader made without ``eval=True``).
        """
        before = self.sampler.state_dict() if self.sampler is not None else self.take_loaded()
        if before is not None:
            _check_same_data(before, sampler)
            sampler.load_state_dict(before)
        self.sampler = sampler
        self._started_epoch, self._mark, self._open = None, None, False
        self._given_epoch = sampler.epoch

    def take_loaded(self) -> dict[str, Any] | None:
        """The sampler state a resume loaded before any loader existed, once (then None)."""
        loaded, self._loaded = self._loaded, None
        return loaded

    def align(self, sampler: DistributedSampler) -> None:
        """Before a pass over the job's loader: the sampler reads the job's epoch.

        Without ``Job.epochs()`` a finished epoch moves the job on to the next, and an epoch
        the program chose itself (``loader.sampler.set_epoch(epoch)``, torch's idiom) becomes
        the job's.
        """
        if sampler is not self.sampler:
            return
        state = self.state
        if not state.epochs_driven and sampler.epoch != self._given_epoch:
            state.epoch = sampler.epoch  # the program's own set_epoch
        elif sampler.remaining == 0 and sampler.epoch == state.epoch and not state.epochs_driven:
            state.epoch += 1
        if sampler.epoch != state.epoch:
            sampler.set_epoch(state.epoch)
        self._given_epoch = sampler.epoch

    # ---- events of the loop ----------------------------------------------------------------
    def started(self, sampler: DistributedSampler) -> None:
        """A loader iterator over ``sampler``'s epoch exists (it drew its seed)."""
        if sampler is self.sampler:
            self._started_epoch = sampler.epoch

    def fetching(self, sampler: DistributedSampler) -> None:
        """The loader is about to fetch a batch: replay the generators after a mid-epoch
        resume; snapshot the resume point unless a batch since the last step is open."""
        if sampler is not self.sampler:
            return
        if self._replay is not None:
            rng.apply(self._replay)
            self._replay = None
        if not self._open:
            self._mark = _Mark(sampler.state_dict(), rng.snapshot())

    def fetched(self, sampler: DistributedSampler, n_samples: int) -> None:
        """The loader hands a batch of ``n_samples`` to the loop."""
        if sampler is self.sampler:
            sampler.advance(n_samples)
            self._open = True

    def abandoned(self, sampler: DistributedSampler) -> None:
        """The loop left a pass before its end (``break``): the rest of the epoch is skipped,
        by the running job and by a job resumed from a save taken now alike."""
        if sampler is self.sampler and sampler.remaining > 0:
            sampler.advance(sampler.remaining)
            self._open, self._mark = False, None

    def stepped(self, pending: bool) -> None:
        """``job.step()`` returned; ``pending``: micro-steps wait for the next optimizer step."""
        self._open = pending

    # ---- save and resume -------------------------------------------------------------------
    def record(self, epoch: int) -> Record:
        """The resume point now; ``epoch`` is the job's (used when it has no loader).

        Batches handed out since the last optimizer step (micro-steps pending, or a batch
        fetched and not trained) are not in the weights: the resume point is then before the
        first of them, with the generators as they were there.
        """
        sampler = self.sampler
        if sampler is None:  # no position: the epoch can only be redone whole, count it done
            return Record(epoch, True, None, rng.capture(), REPLAY_NOW)
        if self._open and self._mark is not None:
            state, snap, iterating = self._mark.sampler, self._mark.generators, True
        else:
            state, snap = sampler.state_dict(), rng.snapshot()
            iterating = self._started_epoch == sampler.epoch
        done = state["position"] >= state["num_samples"]
        rng_at = REPLAY_AT_BATCH if iterating and not done else REPLAY_NOW
        return Record(int(state["epoch"]), done, state, rng.capture(snap), rng_at)

    def resumed(self, state: dict[str, Any], sampler: dict[str, Any] | None, where: str) -> int:
        """A checkpoint was loaded (generators restored); return the epoch to start from.

        ``state`` is :meth:`Record.job_state` as saved; ``sampler`` the saved sampler state,
        taken over by the job's loader when it is made after the resume (loaded directly into
        one made before). After a mid-epoch save the restored generators are set aside and
        replayed when the loader fetches its first batch.

        Raises:
            ValueError: naming ``where`` when ``state`` is malformed.
        """
        try:
            epoch, done = int(state["epoch"]), bool(state.get("epoch_done", False))
            rng_at = state.get("rng_at", REPLAY_NOW)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed job state {state!r} ({exc!r})") from None
        self._open, self._mark, self._started_epoch = False, None, None
        self._replay = rng.snapshot() if rng_at == REPLAY_AT_BATCH else None
        if self.sampler is None:
            self._loaded = sampler
        else:
            self._given_epoch = self.sampler.epoch
        return epoch + 1 if done else epoch


def _check_same_data(before: dict[str, Any], sampler: DistributedSampler) -> None:
    """A new training loader must read a dataset of the same size as the job's."""
    saved, here = before.get("dataset_len"), sampler.state_dict().get("dataset_len")
    if saved is not None and saved != here:
        raise ValueError(
            f"Job.loader(dataset of {here} samples): the job trains on a dataset of {saved} "
            f"samples, and a job has one training loader (a new one takes over its place); "
            f"a loader over other data for evaluation takes eval=True "
            f"(job.loader(dataset, batch_size, eval=True))"
        )


class ResumableLoader(torch.utils.data.DataLoader[Any]):
    """``job.loader()``'s DataLoader: tells its :class:`ResumePoint` about each batch it hands
    out and runs the job's :class:`LoopHooks` (iterating it directly or through
    ``job.progress`` is the same)."""

    def __init__(self, point: ResumePoint, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.point = point

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's
        sampler = self.sampler
        assert isinstance(sampler, DistributedSampler)
        if sampler is not self.point.sampler:
            raise ValueError(
                "this loader was replaced by a newer job.loader(...) call: iterate the newest "
                "one (a job has one training loader, whose place each new one takes over; "
                "loaders for evaluation take eval=True)"
            )
        self.point.align(sampler)
        batches = super().__iter__()  # draws the workers' base seed from torch's generator
        self.point.started(sampler)
        return self._hand_out(batches, sampler)

    def _hand_out(self, batches: Iterator[Any], sampler: DistributedSampler) -> Iterator[Any]:
        size, hooks = self.batch_size or 1, self.point.hooks
        hooks.started()
        try:
            while True:
                self.point.fetching(sampler)
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                left = sampler.remaining
                taken = min(size, left)
                if self.drop_last and left - taken < size:
                    taken = left  # the loader drops the short rest: this batch ends the epoch
                self.point.fetched(sampler, taken)
                if not hooks.batch(sampler.remaining == 0, taken):
                    return
                yield batch
        except GeneratorExit:  # the loop left the pass (break)
            self.point.abandoned(sampler)
            raise
        finally:
            hooks.ended()
