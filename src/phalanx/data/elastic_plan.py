"""What each step consumes at any world size: the epoch's order cut into global batches.

Pure planning, no process group. Three rules make "every sample exactly once per epoch" hold
across changes of membership (issue 19, point 4):

1. **The epoch's order depends only on (seed, epoch, dataset size, shuffle)**
   (:func:`epoch_order`): one permutation seeded by ``seed + epoch``, the one
   :class:`~phalanx.data.DistributedSampler` and torch's sampler deal out, never a function of
   the world size.
2. **Committed steps consume that order in global batches** of a fixed size ``G``: a step that
   starts at position ``start`` (the *cursor*: samples of the epoch consumed by committed steps)
   takes ``order[start : start + G]``. The last batch of an epoch is the partial rest
   ``N % G`` (or, with ``drop_last``, that rest is not trained this epoch). Because the global
   batch never depends on the world size, a run that shrinks or grows trains the same global
   batches as a fault-free run, and only the floating-point reassociation of the mean differs.
3. **A step's global batch is split over the W ranks of the step** (:func:`split_counts`):
   contiguous slices in rank order, the first ``G % W`` ranks one sample longer, so counts
   differ by at most one.

Weighting the loss: with a step of ``B`` samples split into counts ``b_r``, the global mean loss is
``sum_r (b_r / B) * mean_r``. When the gradients are *averaged* over the W ranks (DDP), rank ``r``
must therefore scale its local mean loss by :meth:`StepPlan.mean_scale` ``= W * b_r / B``
(1 when ``W`` divides ``B``); when they are *summed*, by :meth:`StepPlan.share` ``= b_r / B``.
Equivalently, scale the local *sum* of per-sample losses by ``W / B``, which also covers a rank
with ``b_r = 0`` (it takes part in the collectives with a zero gradient; this only happens in an
epoch's last partial batch when fewer samples than ranks are left).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepPlan", "epoch_order", "split_counts", "steps_per_epoch"]


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The epoch's sample order: ``randperm(size)`` seeded by ``seed + epoch``, or ``arange``.

    The same permutation as :class:`~phalanx.data.DistributedSampler` and torch's sampler use
    (before they deal it to ranks), for every world size.
    """
    if not shuffle:
        return torch.arange(size)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g)


def split_counts(total: int, num_replicas: int) -> tuple[int, ...]:
    """``total`` samples over ``num_replicas`` ranks: counts that differ by at most one, the
    first ``total % num_replicas`` ranks holding the extra sample."""
    assert total >= 0 and num_replicas >= 1, (total, num_replicas)
    base, extra = divmod(total, num_replicas)
    return tuple(base + (r < extra) for r in range(num_replicas))


def used_per_epoch(size: int, global_batch_size: int, drop_last: bool) -> int:
    """Samples of an epoch that steps consume: all of them, or the full global batches."""
    return size - size % global_batch_size if drop_last else size


def steps_per_epoch(size: int, global_batch_size: int, drop_last: bool) -> int:
    """Committed steps in an epoch of ``size`` samples: ``floor`` or ``ceil(size / G)``."""
    return -(-used_per_epoch(size, global_batch_size, drop_last) // global_batch_size)


@dataclass(frozen=True)
class StepPlan:
    """One step: which positions of the epoch's order it consumes, and each rank's share."""

    epoch: int
    """The epoch the step belongs to."""
    step: int
    """Steps committed before this one (over all epochs): the step's number."""
    start: int
    """Position in the epoch's order of the step's first sample (the cursor before it)."""
    counts: tuple[int, ...]
    """Samples of each rank, indexed by rank in the step's membership."""

    @property
    def total(self) -> int:
        """Samples of the step over all ranks: the global batch (smaller at an epoch's end)."""
        return sum(self.counts)

    @property
    def num_replicas(self) -> int:
        """The world size the step was planned for."""
        return len(self.counts)

    def positions(self, rank: int) -> range:
        """Positions in the epoch's order that ``rank`` trains in this step."""
        self._check_rank(rank)
        first = self.start + sum(self.counts[:rank])
        return range(first, first + self.counts[rank])

    def share(self, rank: int) -> float:
        """``rank``'s fraction of the step's samples: its weight when gradients are summed."""
        self._check_rank(rank)
        return self.counts[rank] / self.total

    def mean_scale(self, rank: int) -> float:
        """Factor on ``rank``'s mean loss when gradients are averaged over ranks (DDP):
        ``num_replicas * count / total``, so the average is the exact global mean."""
        return self.num_replicas * self.share(rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_replicas:
            raise ValueError(
                f"StepPlan: rank={rank} must be in [0, num_replicas) with "
                f"num_replicas={self.num_replicas} (the step's membership)"
            )


def plan_step(
    epoch: int, step: int, cursor: int, used: int, global_batch_size: int, num_replicas: int
) -> StepPlan | None:
    """The step that starts at ``cursor`` of an epoch whose steps use ``used`` samples, or None
    when the epoch has no step left."""
    total = min(global_batch_size, used - cursor)
    if total <= 0:
        return None
    return StepPlan(epoch, step, cursor, split_counts(total, num_replicas))
