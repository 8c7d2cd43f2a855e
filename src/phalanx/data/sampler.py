"""DistributedSampler: torch's sampler, plus equal full batches per rank and a resumable position.

With the default arguments the indices are exactly those of
``torch.utils.data.distributed.DistributedSampler`` for the same dataset size, replicas, rank,
seed, epoch, ``shuffle`` and ``drop_last``: one permutation per epoch (seeded by ``seed + epoch``),
extended cyclically or cut to ``total_size``, and dealt to the ranks round-robin
(``rank, rank + R, rank + 2R, ...``).

How many indices each rank gets (N samples, R replicas, B = ``batch_size``):

=========================  ===============  ========================================  ===========
mode                       ``drop_last``    indices per rank (``len(sampler)``)       duplicates
=========================  ===============  ========================================  ===========
torch's (default)          False            ``ceil(N / R)``                           < R in all
torch's (default)          True             ``N // R``; the last ``N % R`` dropped    none
``batch_size=B``           False            ``ceil(N / (R*B)) * B``                   < R*B in all
``batch_size=B``           True             ``(N // (R*B)) * B``; the rest dropped    none
``even_batches=False``     False            ``ceil((N - rank) / R)``: differ by <= 1  none
``even_batches=False``     True             as torch's ``drop_last=True``             none
=========================  ===============  ========================================  ===========

With ``batch_size`` (and ``even_batches=True``, the default) every rank therefore yields the same
number of indices, a multiple of ``batch_size``: a DataLoader with that batch size gives every rank
the same number of *full* batches, so no rank waits forever in a collective at the end of an epoch
and every step sees equal shapes. Padding wraps around to the start of the epoch's permutation
(as torch pads samples); the padded (duplicate) indices are always the **last**
:attr:`DistributedSampler.padding` indices a rank yields in the epoch, so a training loop that
knows its position can exclude them from metrics. ``drop_last=True`` drops the tail of the epoch's
permutation instead (a different tail each shuffled epoch) and never duplicates.

Edge cases are torch's: an empty dataset, or ``drop_last`` with fewer samples than replicas
(or than ``num_replicas * batch_size``), yields nothing (with a warning when samples exist but
are all dropped); left at ``None``, ``num_replicas`` and ``rank`` come from the initialised
default process group, and without one the sampler raises ``ValueError`` as torch's does
(it never silently takes the whole dataset on every process).

Resuming: the sampler does not watch its own iterator (a DataLoader prefetches indices ahead of
the batches the loop has actually consumed). Whoever hands batches to the loop calls
:meth:`DistributedSampler.advance` with the number of samples of each batch as it hands it out
(``phalanx.Job``'s loader does, see ``phalanx/train/resume_point.py``); :meth:`state_dict` records
the epoch and that position, and after :meth:`load_state_dict` the next ``iter(sampler)`` skips
the indices already consumed in the epoch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from phalanx._check import FLAG, check_dataset, check_int, checked, optional, rule
from phalanx.data.elastic_plan import epoch_order

__all__ = ["DistributedSampler"]


def _default(name: str, value: int | None, of_group: str) -> int:
    """``value``, or the default process group's world size / rank (as torch)."""
    if value is not None:
        return value
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"DistributedSampler: {name}=None takes the default process group's {of_group}, "
            f"but the default process group has not been initialized; call "
            f"phalanx.init_process_group() first, or pass num_replicas= and rank="
        )
    return dist.get_world_size() if name == "num_replicas" else dist.get_rank()


def _per_rank(n: int, replicas: int, batch_size: int | None, drop_last: bool) -> int:
    """Indices per rank for the even modes (see the module docstring's table)."""
    if batch_size is None:
        return n // replicas if drop_last else math.ceil(n / replicas)
    chunk = replicas * batch_size
    return (n // chunk) * batch_size if drop_last else math.ceil(n / chunk) * batch_size


class DistributedSampler(Sampler[int]):
    """Shard a map-style dataset over ranks; torch-compatible, resumable, optionally batch-even.

    Args:
        dataset: A dataset with ``__len__``.
        num_replicas: Number of ranks sharing the dataset (default: the default process
            group's world size).
        rank: This rank, in ``[0, num_replicas)`` (default: the rank in that group).
        shuffle: Shuffle with a permutation seeded by ``seed + epoch``.
        seed: Base seed; must be the same on every rank.
        drop_last: Drop the tail instead of padding with duplicates.
        even_batches: Give every rank the same number of indices (True, like torch). False never
            pads nor drops beyond ``drop_last``: each sample exactly once, ranks' counts differ by
            at most one (for loops that handle uneven inputs themselves).
        batch_size: With ``even_batches``, pad (or with ``drop_last``, cut) to a multiple of
            ``num_replicas * batch_size`` so every rank gets the same number of full batches.

    Raises:
        ValueError: for ``num_replicas < 1``, a rank outside ``[0, num_replicas)``,
            ``batch_size < 1``, or ``num_replicas`` / ``rank`` left at None without an
            initialised default process group (the exception types of torch's sampler).
        TypeError: an argument of the wrong type (``shuffle="no"``, ``seed="x"``, a dataset
            without a length...).
    """

    @checked(
        dataset=rule(check_dataset),
        num_replicas=optional(rule(check_int)),
        rank=optional(rule(check_int)),
        shuffle=FLAG,
        seed=rule(check_int),
        drop_last=FLAG,
        even_batches=FLAG,
        batch_size=optional(rule(check_int, min=1)),
    )
    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        even_batches: bool = True,
        batch_size: int | None = None,
    ) -> None:
        num_replicas = _default("num_replicas", num_replicas, "world size")
        rank = _default("rank", rank, "rank")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"DistributedSampler: rank={rank} must be in [0, num_replicas) with "
                f"num_replicas >= 1, got num_replicas={num_replicas}"
            )
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.even_batches, self.batch_size = even_batches, batch_size
        self.epoch = 0
        self.position = 0
        """Indices of this epoch already consumed (see :meth:`advance`)."""
        self._n = len(dataset)
        self.num_samples = self._count()
        """Indices this rank yields per epoch (``len(self)``)."""
        uneven = not even_batches and not drop_last
        self.total_size = self._n if uneven else self.num_samples * num_replicas
        """Indices over all ranks per epoch (padded or cut; the dataset size when uneven)."""

    def _count(self) -> int:
        n, r, b = self._n, self.num_replicas, self.batch_size
        if not self.even_batches:
            if not self.drop_last:
                return math.ceil((n - self.rank) / r)
            b = None
        count = _per_rank(n, r, b, self.drop_last)
        if count == 0 and n > 0:
            need = f"num_replicas={r}" if b is None else f"num_replicas*batch_size={r}*{b}={r * b}"
            warnings.warn(
                f"DistributedSampler: drop_last=True drops all {n} samples (fewer than {need}): "
                f"rank {self.rank} yields nothing; use drop_last=False (pads with duplicates)",
                stacklevel=4,  # the user's call: _count, __init__, the check wrapper
            )
        return count

    def __len__(self) -> int:
        """Indices per epoch for this rank (the whole epoch, whatever :attr:`position` is)."""
        return self.num_samples

    @property
    def padding(self) -> int:
        """Padded (duplicate) indices among this rank's ``len(self)`` this epoch: the last ones."""
        if self.drop_last or not self.even_batches:
            return 0
        # This rank's k-th index sits at global position rank + k*R; positions >= N are padding.
        real = max(0, -((self.rank - self._n) // self.num_replicas))
        return self.num_samples - min(real, self.num_samples)

    @property
    def remaining(self) -> int:
        """Indices left in this epoch: ``len(self) - position``."""
        return self.num_samples - self.position

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; moving to another epoch resets :attr:`position`."""
        epoch = check_int("epoch", epoch, min=0, where="DistributedSampler.set_epoch")
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def advance(self, n_samples: int) -> None:
        """Record that ``n_samples`` more samples of this epoch went to the loop.

        Call it as each batch is handed out, with the batch's length (``phalanx.Job``'s loader
        does); :meth:`state_dict` then says where to resume. Reaching ``len(self)`` means the
        epoch is done; the next ``iter()`` of the same epoch then starts it over (as torch's
        sampler does) unless :meth:`set_epoch` moves on.
        """
        n_samples = check_int("n_samples", n_samples, where="DistributedSampler.advance")
        if n_samples < 0 or self.position + n_samples > self.num_samples:
            raise ValueError(
                f"DistributedSampler.advance: n_samples={n_samples} would move the position from "
                f"{self.position} outside [0, {self.num_samples}] (this rank's samples per epoch)"
            )
        self.position += n_samples

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self._n:
            raise RuntimeError(
                f"DistributedSampler: the dataset changed size from {self._n} to "
                f"{len(self.dataset)} after the sampler was built; build a new sampler"
            )
        if self.position >= self.num_samples:
            self.position = 0
        if self.num_samples == 0:
            return iter([])
        start = self.position
        # Global position p holds permutation[p % N]: torch's cyclic padding (or its cut).
        first = min(self.rank + start * self.num_replicas, self.total_size)
        positions = torch.arange(first, self.total_size, self.num_replicas)
        order = epoch_order(self._n, self.seed, self.epoch, self.shuffle)
        return iter(order[positions % self._n].tolist())

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: epoch, consumed indices, seed, and the layout they refer to."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "dataset_len": self._n,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch, seed and position; the next ``iter()`` resumes after the consumed ones.

        A finished epoch (``position`` equal to the saved per-rank count) loads into any
        sampler over the same data: it stays finished.

        Raises:
            ValueError: when resuming mid-epoch (``position > 0``) with a different number of
                replicas, dataset size, per-rank count or ``shuffle``: the consumed indices
                would not match.
        """
        position = int(state.get("position", 0))
        if position and position == state.get("num_samples"):
            # The saved epoch was finished: nothing of it is left to skip, whatever the
            # number of replicas now (an elastic restart at another world size).
            position = self.num_samples
        elif position:
            keys = ("num_replicas", "dataset_len", "num_samples", "shuffle")
            saved = tuple(state.get(k) for k in keys)
            here = (self.num_replicas, self._n, self.num_samples, self.shuffle)
            if saved != here or not 0 <= position <= self.num_samples:
                raise ValueError(
                    f"DistributedSampler.load_state_dict: cannot resume mid-epoch at "
                    f"position={position}: saved {keys}={saved}, "
                    f"this sampler has {here}; resume at an epoch boundary (position=0) instead"
                )
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.position = position
