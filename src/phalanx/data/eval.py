"""Exact evaluation data: every sample read once over the replicas, in contiguous blocks.

A training sampler pads the ranks to equal counts by repeating samples (so no rank waits in a
collective); a metric computed over those batches counts the repeats twice. :class:`EvalSampler`
never pads nor drops: replica ``r`` of ``R`` reads the ``r``-th contiguous block of the epoch's
order (the dataset's order, or one permutation with ``shuffle=True``), the first ``N % R`` blocks
one sample longer than the rest. Blocks in replica order are that whole order, so per-sample
results gathered in rank order (``phalanx.Job.gather``) come back in the dataset's order when
not shuffled. Replicas may then get different numbers of batches: a loop over an
:class:`EvalLoader` must not run collectives per batch (gather once, after the loop).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, Sampler

from phalanx._check import FLAG, check_dataset, check_int, checked, rule
from phalanx.data.elastic_plan import epoch_order

__all__ = ["EvalLoader", "EvalSampler"]


class EvalSampler(Sampler[int]):
    """This replica's contiguous block of the dataset: each sample exactly once over replicas.

    Args:
        dataset: A dataset with ``__len__``.
        num_replicas: Number of replicas sharing the dataset.
        rank: This replica, in ``[0, num_replicas)``.
        shuffle: Read the blocks of one permutation seeded by ``seed + epoch`` instead of the
            dataset's order (the same on every replica when ``seed`` is).
        seed: Base seed of the permutation; must be the same on every replica.

    Raises:
        ValueError: ``num_replicas < 1`` or a rank outside ``[0, num_replicas)``.
        TypeError: an argument of the wrong type.
    """

    @checked(
        dataset=rule(check_dataset),
        num_replicas=rule(check_int, min=1),
        rank=rule(check_int, min=0),
        shuffle=FLAG,
        seed=rule(check_int),
    )
    def __init__(
        self, dataset: Sized, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0
    ) -> None:
        if rank >= num_replicas:
            raise ValueError(
                f"EvalSampler: rank={rank} must be in [0, num_replicas), got "
                f"num_replicas={num_replicas}"
            )
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        n = len(dataset)
        base, extra = divmod(n, num_replicas)
        self.start = rank * base + min(rank, extra)
        """First position of this replica's block in the epoch's order."""
        self.num_samples = base + (rank < extra)
        """Samples this replica reads (``len(self)``): the counts differ by at most one."""

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``shuffle=True`` (``seed + epoch``)."""
        self.epoch = check_int("epoch", epoch, min=0, where="EvalSampler.set_epoch")

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:  # the dataset's order, without building it whole
            return iter(range(self.start, self.start + self.num_samples))
        order = epoch_order(len(self.dataset), self.seed, self.epoch, shuffle=True)
        return iter(order[self.start : self.start + self.num_samples].tolist())


class EvalLoader(DataLoader[Any]):
    """``phalanx.Job.loader(..., eval=True)``'s DataLoader, over an :class:`EvalSampler`.

    Its own class so that ``Job.progress`` knows it is not training: no gradient-sync flags,
    step timing or parameter-server pulls around its batches.
    """
