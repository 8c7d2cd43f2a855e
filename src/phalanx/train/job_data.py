"""The data side of :class:`phalanx.Job`: its loaders, exact evaluation and ``gather``.

Training loaders use the job's sampler (``phalanx.DistributedSampler``): it pads the replicas to
equal full batches (``even_batches``), is set to each epoch by ``Job.epochs`` and its position
advances as batches are handed out (loop over the loader or ``job.progress(loader)``), so
``Job.save`` can be called after any step (:mod:`phalanx.train.resume_point`).

``eval=True`` loaders read every sample exactly once over the replicas, never repeated nor
dropped (``phalanx.data.eval.EvalSampler``: contiguous blocks, in the dataset's order unless
``shuffle=True``). Replicas may get different numbers of batches, so run no collective per
batch: collect the outputs and ``job.gather`` them after the loop. An eval loader is not the
job's sampler (checkpoints neither record nor change it); ``drop_last`` and ``even_batches``
do not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING

import torch

from phalanx.data.eval import EvalLoader, EvalSampler
from phalanx.data.sampler import DistributedSampler
from phalanx.train.gather import Number, gather
from phalanx.train.loop_helpers import batch_len, batches_left, to_device
from phalanx.train.resume_point import ResumableLoader

if TYPE_CHECKING:  # the job calls these with itself; no import at run time
    from phalanx.train.job import Job

__all__ = ["DATA_SEED", "gather_values", "make_loader", "progress"]

DATA_SEED = 0
"""The loaders' shuffle seed of a ``Job(seed=None)`` (torch's ``DistributedSampler`` default):
a constant, so every rank agrees without a broadcast, every run shuffles alike, and a resumed job
(which also restores the sampler's seed) shuffles as the saved one. Strategies that keep each
rank's own build of the model (``Mesh`` with tp > 1, ``PS`` with several servers,
``TorchFSDP``) need ``Job(seed=N)`` or an equal build on every rank; DDP, ``Zero`` and a
pipeline's replicas start from one rank's parameters anyway."""


def make_loader(
    job: Job,
    dataset: Sized,
    batch_size: int,
    shuffle: bool | None,
    drop_last: bool,
    even_batches: bool,
    eval: bool,
    kwargs: dict[str, object],
) -> torch.utils.data.DataLoader[object]:
    """``job.loader(...)``: ranks of one replica read the same samples, replicas different ones."""
    replicas, replica = job.runner.data_shard()
    for given in ("sampler", "batch_sampler"):
        if given in kwargs:
            raise ValueError(
                f"Job.loader({given}={kwargs[given]!r}): the job builds its own sampler "
                f"(eval=True for evaluation); drop {given}="
            )
    if eval:  # not shuffled unless asked; not the job's sampler
        order = False if shuffle is None else shuffle
        once = EvalSampler(dataset, replicas, replica, order, job.data_seed)
        return EvalLoader(dataset, batch_size, sampler=once, **kwargs)  # type: ignore[arg-type]
    if job.live is not None:  # global batches over the membership of each step
        order = True if shuffle is None else shuffle
        shards = job.live.batch_sampler(job, dataset, batch_size, order, drop_last)
        return torch.utils.data.DataLoader(dataset, batch_sampler=shards, **kwargs)  # type: ignore[arg-type]
    sampler = DistributedSampler(
        dataset,
        num_replicas=replicas,
        rank=replica,
        shuffle=True if shuffle is None else shuffle,
        seed=job.data_seed,
        drop_last=drop_last,
        even_batches=even_batches,
        batch_size=batch_size,
    )
    job.resume_point.follow(sampler)
    job.sampler = sampler
    return ResumableLoader(
        job.resume_point,
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        **kwargs,
    )


def progress(
    job: Job, loader: Iterable[object], desc: str | None, next_batch: Callable[[bool], bool]
) -> Iterator[object]:
    """``job.progress(loader)``: batches moved to the device, with a bar on one rank.

    Batches of any structure are moved (tensors inside tuples, lists, dicts, namedtuples,
    ``UserDict`` mappings such as Hugging Face's ``BatchEncoding``; see
    ``loop_helpers.to_device``). A training loader's batch is a micro-step: the gradient-sync
    flag is armed, parameter servers pull, phases are marked (``next_batch(last)``, the job's;
    False: stop). An ``eval=True`` loader's batches are only moved (also after training, on
    parameter-server workers).
    """
    from phalanx.train.progress import progress as bar_over

    shown = job.world.rank == job.runner.role.progress_rank()
    if isinstance(loader, EvalLoader):
        bar = bar_over(loader, desc=desc or "eval", total=len(loader), enabled=shown)
        for batch in bar if not job.is_server else ():
            yield to_device(batch, job.world.device)
        return
    if job.runner.role.serving():
        return
    if isinstance(job.sampler, DistributedSampler):  # the job's epoch, before counting
        job.resume_point.align(job.sampler)
    total = batches_left(loader, job.sampler)
    batches = loader if job.live is None else job.live.batches(job, loader)
    bar = bar_over(batches, desc=desc or f"epoch {job.epoch}", total=total, enabled=shown)
    job.throughput.start_epoch()
    job.timing.enter("data")
    try:
        for i, batch in enumerate(bar):
            if not next_batch(total is not None and i == total - 1):
                break
            batch = to_device(batch, job.world.device)
            job.timing.mark_batch()
            yield batch
            job.throughput.count(batch_len(batch))
            job.profiler.step()
    finally:  # evaluation and checkpoints between epochs are no step's phase
        job.timing.enter(None)


def gather_values(job: Job, value: torch.Tensor | Number) -> torch.Tensor | list[Number]:
    """``value`` from every replica, in replica (rank) order: exact evaluation metrics.

    A tensor of any leading size per rank (the predictions of an ``eval=True`` loader's uneven
    batches, concatenated) comes back as one tensor joined along dimension 0; a Python number
    as the list of every replica's. Ranks of one replica (pipeline stages, tensor shards of a
    ``phalanx.Mesh``) read the same samples, so the gather runs over the data-parallel group
    only (``job.groups.dp``; the workers of a parameter server). Collective: every rank of that
    group calls it, once per value (after the eval loop, not per batch). Nothing is dropped or
    deduplicated: an eval loader pads nothing.

    Raises:
        TypeError: ``value`` is neither a tensor nor a number.
        ValueError: the ranks' tensors differ in dtype or beyond the first dimension (on every
            rank alike); called on a parameter-server rank.
    """
    if job.is_server:
        raise ValueError("Job.gather(): a parameter-server rank holds no replica's values")
    return gather(value, job.runner.replica_group(), job.world.device)
