"""The loaders of :class:`phalanx.Job`: its training loader and exact evaluation loaders.

The training loader uses the job's sampler (``phalanx.DistributedSampler``): it pads the
replicas to equal full batches (``even_batches``), reads the job's epoch and its position
advances as batches are handed out (loop over the loader or ``job.progress(loader)``), so
``Job.save`` can be called after any step (:mod:`phalanx.train.resume_point`). A runner makes it
(``Runner.loader``): live recovery deals its batches otherwise (:mod:`phalanx.train.live`).

``eval=True`` loaders read every sample exactly once over the replicas, never repeated nor
dropped (``phalanx.data.eval.EvalSampler``: contiguous blocks, in the dataset's order unless
``shuffle=True``). Replicas may get different numbers of batches, so run no collective per
batch: collect the outputs and ``job.gather`` them after the loop. An eval loader is not the
job's sampler (checkpoints neither record nor change it); ``drop_last`` and ``even_batches``
do not apply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.data.eval import EvalLoader, EvalSampler
from phalanx.data.sampler import DistributedSampler
from phalanx.train.resume_point import ResumableLoader, ResumePoint
from phalanx.train.train_state import TrainState

__all__ = [
    "BATCH_REPLICAS_VAR",
    "DATA_SEED",
    "LoaderArgs",
    "batch_for",
    "eval_loader",
    "training_loader",
]

BATCH_REPLICAS_VAR = "PHALANX_BATCH_REPLICAS"
"""Set to ``R``: the ``batch_size`` given to ``job.loader`` is per replica at ``R`` data-parallel
replicas, and at another number each replica's batch is scaled to keep the global batch
(``batch_size * R``). ``phalanx verify --mode world`` sets it, so that an unchanged script
trains on the same global batches at both world sizes."""


def batch_for(batch_size: int, replicas: int, env: Mapping[str, str] | None = None) -> int:
    """The per-replica batch of a training loader over ``replicas`` replicas: ``batch_size``,
    or scaled to keep the global batch of :data:`BATCH_REPLICAS_VAR`'s replicas.

    Raises:
        ValueError: the variable is not a positive integer, or the global batch does not
            split evenly over ``replicas``.
    """
    raw = (os.environ if env is None else env).get(BATCH_REPLICAS_VAR, "").strip()
    if not raw:
        return batch_size
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{BATCH_REPLICAS_VAR}={raw!r} must be a positive integer")
    total = batch_size * int(raw)
    if total % replicas:
        raise ValueError(
            f"job.loader(batch_size={batch_size}) with {BATCH_REPLICAS_VAR}={raw}: the global "
            f"batch of {total} does not split evenly over {replicas} replicas; pick world sizes "
            f"that divide it"
        )
    return total // replicas


DATA_SEED = 0
"""The loaders' shuffle seed of a ``Job(seed=None)`` (torch's ``DistributedSampler`` default):
a constant, so every rank agrees without a broadcast, every run shuffles alike, and a resumed job
(which also restores the sampler's seed) shuffles as the saved one. Strategies that keep each
rank's own build of the model (``Mesh`` with tp > 1, ``PS`` with several servers,
``TorchFSDP``) need ``Job(seed=N)`` or an equal build on every rank; DDP, ``Zero`` and a
pipeline's replicas start from one rank's parameters anyway."""


@dataclass(frozen=True)
class LoaderArgs:
    """``job.loader(...)``'s arguments (checked: no ``sampler`` / ``batch_sampler``)."""

    dataset: Sized
    """Sized and indexable (torch's ``Dataset``, a list, Hugging Face's ``datasets``)."""
    batch_size: int
    shuffle: bool | None
    drop_last: bool
    even_batches: bool
    seed: int
    """The job's data seed."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The rest, for torch's ``DataLoader`` (``num_workers``, ``collate_fn``...)."""

    def __post_init__(self) -> None:
        for given in ("sampler", "batch_sampler"):
            if given in self.kwargs:
                raise ValueError(
                    f"Job.loader({given}={self.kwargs[given]!r}): the job builds its own sampler "
                    f"(eval=True for evaluation); drop {given}="
                )


def eval_loader(args: LoaderArgs, replicas: int, replica: int) -> EvalLoader:
    """An ``eval=True`` loader: every sample once over the replicas, not the job's sampler."""
    order = False if args.shuffle is None else args.shuffle  # not shuffled unless asked
    once = EvalSampler(args.dataset, replicas, replica, order, args.seed)
    # torch types DataLoader for its Dataset class; any sized, indexable dataset works.
    return EvalLoader(args.dataset, args.batch_size, sampler=once, **args.kwargs)  # type: ignore[arg-type]


def training_loader(
    args: LoaderArgs, replicas: int, replica: int, state: TrainState, point: ResumePoint
) -> torch.utils.data.DataLoader[Any]:
    """The job's training loader over replica ``replica`` of ``replicas``: ranks of one
    replica read the same samples. Its sampler becomes ``state.sampler`` and takes over the
    job's position (:meth:`ResumePoint.follow`)."""
    sampler = DistributedSampler(
        args.dataset,
        num_replicas=replicas,
        rank=replica,
        shuffle=True if args.shuffle is None else args.shuffle,
        seed=args.seed,
        drop_last=args.drop_last,
        even_batches=args.even_batches,
        batch_size=args.batch_size,
    )
    point.follow(sampler)
    state.sampler = sampler
    return ResumableLoader(
        point,
        args.dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=args.drop_last,
        **args.kwargs,
    )
