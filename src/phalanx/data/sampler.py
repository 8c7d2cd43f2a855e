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

Resuming at another number of replicas (an elastic restart after a host was lost, or a restart
with more processes): the epoch's *global sequence* (entry ``p`` holds ``permutation[p % N]``)
depends on the seed, the epoch, ``N`` and ``shuffle`` only, and rank ``r``'s ``k``-th index is
entry ``r + k*R``. When every rank is at position ``k`` (ranks that step together are), the ranks
together have consumed exactly the first ``k*R`` entries (:attr:`DistributedSampler.consumed`),
whatever each rank's own shard was, and every rank's state says so. A sampler over ``R'``
replicas that loads such a state deals the rest of the sequence from entry ``start = k*R`` on as
it deals a whole epoch: rank ``r``'s ``k``-th index is entry ``start + r + k*R'``, with the
counts of the table above for the ``N - start`` samples left, padded (wrapping to the epoch's
first samples) or cut as configured. Every sample of the epoch is then trained exactly once over
the two runs, plus the padding of the last batch (or minus the cut tail, with ``drop_last``). The
next epoch is dealt whole again. A state saved at the same number of replicas, and a finished
epoch, load as they were saved.
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
        self.start = 0
        """Entries of this epoch's global sequence consumed before this sampler dealt it: 0,
        except in an epoch resumed from a save at another number of replicas (see the module
        docstring); the next epoch starts at 0 again."""
        self.num_samples = 0
        """Indices this rank yields in the epoch from :attr:`start` on (``len(self)``)."""
        self.total_size = 0
        """Entries of the epoch's global sequence dealt (padded or cut; the dataset size when
        uneven), counted from its beginning."""
        self._lay_out(0, warn=True)

    def _lay_out(self, start: int, *, warn: bool = False) -> None:
        """Deal the epoch's global sequence from entry ``start`` on (0: the whole epoch)."""
        self.start = start
        self.num_samples = self._count(self._n - start, warn)
        uneven = not self.even_batches and not self.drop_last
        self.total_size = self._n if uneven else start + self.num_samples * self.num_replicas

    def _count(self, n: int, warn: bool = False) -> int:
        """This rank's indices when ``n`` samples are dealt (see the module docstring)."""
        r, b = self.num_replicas, self.batch_size
        if not self.even_batches:
            if not self.drop_last:
                return max(0, math.ceil((n - self.rank) / r))
            b = None
        count = _per_rank(n, r, b, self.drop_last)
        if count == 0 and n > 0 and warn:
            need = f"num_replicas={r}" if b is None else f"num_replicas*batch_size={r}*{b}={r * b}"
            warnings.warn(
                f"DistributedSampler: drop_last=True drops all {n} samples (fewer than {need}): "
                f"rank {self.rank} yields nothing; use drop_last=False (pads with duplicates)",
                stacklevel=5,  # the user's call: _count, _lay_out, __init__, the check wrapper
            )
        return count

    def __len__(self) -> int:
        """Indices per epoch for this rank (the whole epoch, whatever :attr:`position` is; after
        a resume at another number of replicas, the rest of that epoch from :attr:`start`)."""
        return self.num_samples

    @property
    def padding(self) -> int:
        """Padded (duplicate) indices among this rank's ``len(self)`` this epoch: the last ones."""
        if self.drop_last or not self.even_batches:
            return 0
        # This rank's k-th index sits at global position start + rank + k*R; those >= N are
        # padding.
        real = max(0, -((self.start + self.rank - self._n) // self.num_replicas))
        return self.num_samples - min(real, self.num_samples)

    @property
    def consumed(self) -> int:
        """Entries of the epoch's global sequence consumed over all ranks, when every rank is at
        this :attr:`position`: ``start + position * num_replicas`` (padding included)."""
        return self.start + self.position * self.num_replicas

    @property
    def remaining(self) -> int:
        """Indices left in this epoch: ``len(self) - position``."""
        return self.num_samples - self.position

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; moving to another epoch resets :attr:`position`."""
        epoch = check_int("epoch", epoch, min=0, where="DistributedSampler.set_epoch")
        if epoch != self.epoch:
            self.position = 0
            if self.start:
                self._lay_out(0)  # a resumed epoch's rest was dealt from start; others whole
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
        if self.position >= self.num_samples > 0:
            self.position = 0  # the epoch over again, whole (as torch's sampler reads it again)
            if self.start:
                self._lay_out(0)
        if self.num_samples == 0:
            return iter([])
        # Global position p holds permutation[p % N]: torch's cyclic padding (or its cut).
        first = min(self.start + self.rank + self.position * self.num_replicas, self.total_size)
        positions = torch.arange(first, self.total_size, self.num_replicas)
        order = epoch_order(self._n, self.seed, self.epoch, self.shuffle)
        return iter(order[positions % self._n].tolist())

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: epoch, consumed indices, seed, and the layout they refer to.

        ``start`` and ``num_replicas`` place ``position`` in the epoch's global sequence (see
        :attr:`consumed`), so that a sampler over another number of replicas can continue it.
        """
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "dataset_len": self._n,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "start": self.start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch, seed and position; the next ``iter()`` resumes after the consumed ones.

        A state saved with this layout (the same number of replicas, dataset size, per-rank
        count and ``shuffle``) loads as it was saved. A finished epoch (``position`` equal to
        the saved per-rank count) loads into any sampler over the same data: it stays finished.
        A state saved inside an epoch by another number of replicas (or another ``batch_size``
        or ``drop_last``) loads as the number of entries of the epoch's global sequence all
        ranks consumed (:attr:`consumed`); this sampler deals the rest of that epoch over its
        replicas (see the module docstring). So does an :class:`~phalanx.data.ElasticSampler`
        state (a ``Job(recovery='live')`` checkpoint), whose ``cursor`` is that count.

        Raises:
            ValueError: a state saved inside an epoch, at another layout, over a dataset of
                another size or with another ``shuffle`` (the consumed entries of the saved
                order are other samples in this one); a state missing the keys that place its
                position, or with a position outside the saved per-rank count.
        """
        where = "DistributedSampler.load_state_dict"
        consumed = _consumed(state, where)
        epoch, seed = int(state["epoch"]), int(state.get("seed", self.seed))
        start, position = 0, 0
        if consumed is None:  # the saved epoch was finished: it stays finished
            position = self._count(self._n)
            start = 0 if position else self._n  # none of it here: an empty rest, not a start
        elif self._same_layout(state):
            start, position = int(state.get("start", 0)), int(state["position"])
        elif consumed:
            self._check_same_order(state, consumed, epoch)
            start = min(consumed, self._n)  # beyond N: only padding was left
        self._lay_out(start)
        self.epoch, self.seed, self.position = epoch, seed, position

    def _same_layout(self, state: dict[str, Any]) -> bool:
        """``state`` was saved by a sampler dealing this epoch as this one would (each rank's
        indices at the same entries of the same global sequence)."""
        start = state.get("start", 0)
        if not isinstance(start, int) or not 0 <= start <= self._n:
            return False
        here = (self.num_replicas, self._n, self.shuffle, self._count(self._n - start))
        saved = tuple(state.get(k) for k in ("num_replicas", "dataset_len", "shuffle"))
        return (*saved, state.get("num_samples")) == here

    def _check_same_order(self, state: dict[str, Any], consumed: int, epoch: int) -> None:
        """The saved state's consumed entries name the same samples in this sampler's order."""
        saved = (state.get("dataset_len"), state.get("shuffle"))
        if saved == (self._n, self.shuffle):
            return
        raise ValueError(
            f"DistributedSampler.load_state_dict: cannot resume mid-epoch at position="
            f"{state.get('position', state.get('cursor'))}: the saving run had trained the first "
            f"{consumed} entries of epoch {epoch}'s order of dataset_len={saved[0]} samples with "
            f"shuffle={saved[1]}, and this sampler's order is of dataset_len={self._n} with "
            f"shuffle={self.shuffle}: the same entries are other samples here, so some would be "
            f"trained twice and others skipped. Build the sampler (job.loader) over the dataset "
            f"the checkpoint was saved with, with shuffle={saved[1]}, or resume from a "
            f"checkpoint saved at the end of an epoch"
        )


def _consumed(state: dict[str, Any], where: str) -> int | None:
    """Entries of the saved epoch's global sequence the saving run consumed over all its ranks
    (0: none), or None when it finished the epoch.

    Every rank of the saving run is at the same position (ranks step together), so any rank's
    state gives the same count: ``start + position * num_replicas``.
    """
    if "position" not in state and "cursor" in state:  # an ElasticSampler's: the count itself
        return check_int("state['cursor']", state["cursor"], min=0, where=where)
    position = check_int("state['position']", state.get("position", 0), min=0, where=where)
    start = check_int("state['start']", state.get("start", 0), min=0, where=where)
    if position == 0 and start == 0:
        return 0
    missing = [k for k in ("num_replicas", "num_samples") if k not in state]
    if missing:
        raise ValueError(
            f"{where}: state has position={position} but no {', '.join(map(repr, missing))}: "
            f"the samples it consumed cannot be placed in the epoch's order; pass a "
            f"DistributedSampler.state_dict() (or an ElasticSampler's)"
        )
    replicas = check_int("state['num_replicas']", state["num_replicas"], min=1, where=where)
    count = check_int("state['num_samples']", state["num_samples"], min=0, where=where)
    if position > count:
        raise ValueError(
            f"{where}: state['position']={position} exceeds the saved per-rank count "
            f"state['num_samples']={count}: the state is malformed"
        )
    return None if position == count else start + position * replicas
