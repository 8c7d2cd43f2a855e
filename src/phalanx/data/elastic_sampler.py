"""ElasticSampler: every sample exactly once per epoch while ranks leave and join between steps.

A ``batch_sampler`` for torch's DataLoader that yields this rank's sample indices, one list per
step, following the plan of :mod:`phalanx.data.elastic_plan`: a world-size-independent epoch
order, consumed in global batches of ``global_batch_size`` by *committed* steps, each global batch
split over the ranks of the step. Every process keeps its own sampler; they agree because they
share the configuration and commit the same steps.

The training loop tells it two things (``phalanx.Job``'s loader will):

- **a step committed** (the optimizer stepped with the all-reduced gradients of every rank):
  :meth:`ElasticSampler.commit`. Only then does the cursor move on; after the last step of an
  epoch it rolls over to the next epoch (``epoch + 1``, cursor 0).
- **the membership changed** (ranks lost or joined, after a failed collective or at a step
  boundary): :meth:`ElasticSampler.set_membership` with the new world size and this process's
  new rank, then a new ``iter(loader)``. The failed step was not committed, so the new iterator
  starts with it: its global batch, re-split over the new membership. An iterator opened before
  the change raises instead of handing out batches of the old split.

A DataLoader fetches batches ahead of the loop, so the sampler does not infer commits from its
iterator: the batch the loop holds is always the one of :meth:`ElasticSampler.plan` (the next
uncommitted step), as long as every batch is either committed or its iterator dropped.

With ``drop_last=False`` an epoch's last global batch is its ``N % G`` remaining samples, split
the same way; when fewer remain than there are ranks some ranks get an empty list for that step
(they must still join the step's collectives, with a zero gradient). torch's default collate
cannot collate an empty list: pass ``collate_fn=CollateOrNone()``, which hands the loop None for
it, or use ``drop_last=True``.
With ``drop_last=True`` those samples are not trained in that epoch (another epoch's order puts
other samples last). A world larger than the global batch is refused.

:meth:`ElasticSampler.state_dict` holds no world size: epoch, cursor, committed steps, seed and
the configuration they refer to. A job saved at one world size resumes exactly at another, and a
replacement rank joins by loading a live peer's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler, default_collate

from phalanx._check import FLAG, check_dataset, check_int, checked, rule
from phalanx.data.elastic_plan import StepPlan, epoch_order, plan_step, used_per_epoch

__all__ = ["CollateOrNone", "ElasticSampler"]

_FIXED = ("dataset_len", "shuffle", "global_batch_size", "drop_last")
"""Configuration a state must have been saved with: it fixes the sequence of global batches."""
_KEYS = ("epoch", "cursor", "step", "seed", *_FIXED)


class ElasticSampler(Sampler[list[int]]):
    """This rank's indices for each step, from a global cursor over a world-independent order.

    Args:
        dataset: A dataset with ``__len__``.
        global_batch_size: Samples per committed step over all ranks (``G``); fixed for the run.
        num_replicas: Ranks of the current membership (``W``), at most ``global_batch_size``.
        rank: This process's rank in the current membership, in ``[0, num_replicas)``.
        shuffle: Shuffle each epoch with a permutation seeded by ``seed + epoch``.
        seed: Base seed; the same on every rank.
        drop_last: Leave out an epoch's last partial global batch (see the module docstring).

    Raises:
        ValueError: an empty dataset, ``global_batch_size < 1``, ``num_replicas < 1`` or
            greater than ``global_batch_size``, a rank outside ``[0, num_replicas)``.
        TypeError: an argument of the wrong type.
    """

    @checked(
        dataset=rule(check_dataset),
        global_batch_size=rule(check_int, min=1),
        num_replicas=rule(check_int, min=1),
        rank=rule(check_int, min=0),
        shuffle=FLAG,
        seed=rule(check_int),
        drop_last=FLAG,
    )
    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self._n = len(dataset)
        if self._n == 0:
            raise ValueError(
                f"ElasticSampler: dataset={type(dataset).__name__} is empty (len(dataset) = 0): "
                f"an epoch would have no step; pass a dataset with at least one sample"
            )
        self.epoch = 0
        self.cursor = 0
        """Samples of this epoch's order consumed by committed steps."""
        self.step = 0
        """Steps committed so far, over all epochs."""
        self.num_replicas, self.rank = 0, 0
        self._version = 0  # bumped by membership changes and rewinds: open iterators are stale
        self._order: tuple[int, torch.Tensor] | None = None  # 8 bytes a sample
        self.set_membership(num_replicas, rank, where="ElasticSampler")

    # ---- events of the training loop -------------------------------------------------------
    def set_membership(self, num_replicas: int, rank: int, *, where: str = "") -> None:
        """The ranks changed between steps: split the next steps over ``num_replicas`` ranks,
        this process being ``rank``. Start a new iterator afterwards (an open one raises)."""
        where = where or "ElasticSampler.set_membership"
        num_replicas = check_int("num_replicas", num_replicas, min=1, where=where)
        rank = check_int("rank", rank, min=0, where=where)
        if rank >= num_replicas:
            raise ValueError(
                f"{where}: rank={rank} must be in [0, num_replicas), "
                f"got num_replicas={num_replicas}"
            )
        if num_replicas > self.global_batch_size:
            raise ValueError(
                f"{where}: num_replicas={num_replicas} exceeds global_batch_size="
                f"{self.global_batch_size}: some ranks would get no sample in every step; "
                f"use a global batch of at least {num_replicas}"
            )
        self.num_replicas, self.rank = num_replicas, rank
        self._version += 1

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; another epoch than the current one starts at its beginning."""
        epoch = check_int("epoch", epoch, min=0, where="ElasticSampler.set_epoch")
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0
            self._version += 1

    def plan(self) -> StepPlan | None:
        """The next step to train (the first uncommitted one) at the current membership, or
        None when the epoch has no step left (an empty epoch, or all dropped)."""
        used = used_per_epoch(self._n, self.global_batch_size, self.drop_last)
        return plan_step(
            self.epoch, self.step, self.cursor, used, self.global_batch_size, self.num_replicas
        )

    def commit(self, plan: StepPlan | None = None) -> StepPlan:
        """Record that the next step committed; return its plan. After an epoch's last step the
        sampler moves to the next epoch (cursor 0).

        Args:
            plan: The plan the loop trained (optional): checked to be the next step at the
                current membership, so a step committed twice, or one planned before a
                membership change (a failed step, to be redone), raises instead of skipping data.

        Raises:
            ValueError: no step is left in the epoch, or ``plan`` is not the next step.
        """
        current = self.plan()
        if current is None:
            raise ValueError(
                f"ElasticSampler.commit: epoch {self.epoch} has no step left (dataset_len="
                f"{self._n}, global_batch_size={self.global_batch_size}, drop_last="
                f"{self.drop_last}); call set_epoch() for the next epoch"
            )
        if plan is not None and plan != current:
            raise ValueError(
                f"ElasticSampler.commit: plan={plan} is not the next step {current}: it was "
                f"committed already, or planned before a membership change (redo it instead)"
            )
        self.cursor += current.total
        self.step += 1
        if self.plan() is None:
            self.epoch, self.cursor = self.epoch + 1, 0
        return current

    # ---- indices ---------------------------------------------------------------------------
    def indices(self, plan: StepPlan, rank: int | None = None) -> list[int]:
        """The dataset indices ``rank`` (default: this process's) trains in step ``plan``."""
        where = "ElasticSampler.indices"
        rank = self.rank if rank is None else check_int("rank", rank, min=0, where=where)
        span = plan.positions(rank)
        return self._epoch_order(plan.epoch)[span.start : span.stop].tolist()

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if len(self.dataset) != self._n:
            raise RuntimeError(
                f"ElasticSampler: the dataset changed size from {self._n} to "
                f"{len(self.dataset)} after the sampler was built; build a new sampler"
            )
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self._n, self.seed, epoch, self.shuffle))
        return self._order[1]

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's index list for each remaining step of the epoch, assuming they commit."""
        for plan in self.plans():
            yield self.indices(plan)

    def plans(self) -> Iterator[StepPlan]:
        """The plan of each remaining step of the epoch, assuming they commit (a membership or
        epoch change meanwhile makes the iterator raise)."""
        version, epoch, cursor, step = self._version, self.epoch, self.cursor, self.step
        used = used_per_epoch(self._n, self.global_batch_size, self.drop_last)
        while True:
            plan = plan_step(epoch, step, cursor, used, self.global_batch_size, self.num_replicas)
            if plan is None:
                return
            if self._version != version:
                raise RuntimeError(
                    f"ElasticSampler: the membership or epoch changed (now num_replicas="
                    f"{self.num_replicas}, rank={self.rank}, epoch={self.epoch}) while an "
                    f"iterator planned for the old one was open; start a new iterator "
                    f"(iter(loader)) after set_membership() or set_epoch()"
                )
            yield plan
            cursor, step = cursor + plan.total, step + 1

    def __len__(self) -> int:
        """Steps left in the current epoch (from the cursor)."""
        used = used_per_epoch(self._n, self.global_batch_size, self.drop_last)
        return -(-max(0, used - self.cursor) // self.global_batch_size)

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able and world-size independent: where the epoch stands and what it refers to."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "step": self.step,
            "seed": self.seed,
            "dataset_len": self._n,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (saved at any world size) left off, at this membership.

        Raises:
            ValueError: a state saved with another dataset size, ``shuffle``,
                ``global_batch_size`` or ``drop_last`` (its global batches would differ), or
                malformed (missing keys, a cursor not at a step boundary of the epoch).
        """
        where = "ElasticSampler.load_state_dict"
        if not isinstance(state, dict) or not set(_KEYS) <= set(state):
            raise ValueError(f"{where}: state={state!r} is not an ElasticSampler.state_dict()")
        mine = self.state_dict()
        for key in _FIXED:
            if state[key] != mine[key]:
                raise ValueError(
                    f"{where}: state[{key!r}]={state[key]!r} differs from this sampler's "
                    f"{key}={mine[key]!r}; the saved run's global batches cannot be continued"
                )
        epoch = check_int("state['epoch']", state["epoch"], min=0, where=where)
        step = check_int("state['step']", state["step"], min=0, where=where)
        seed = check_int("state['seed']", state["seed"], where=where)
        used = used_per_epoch(self._n, self.global_batch_size, self.drop_last)
        cursor = check_int(
            "state['cursor']", state["cursor"], min=0, max=max(0, used - 1), where=where
        )
        if cursor % self.global_batch_size:
            raise ValueError(
                f"{where}: state['cursor']={cursor} is not a multiple of global_batch_size="
                f"{self.global_batch_size} (committed steps end on global batches)"
            )
        self.epoch, self.cursor, self.step, self.seed = epoch, cursor, step, seed
        self._order = None
        self._version += 1


class CollateOrNone:
    """A DataLoader ``collate_fn`` for :class:`ElasticSampler`: None for an empty batch (a
    rank's empty share of an epoch's last global batch), ``collate_fn(batch)`` otherwise.

    A class rather than a closure, so DataLoader worker processes can receive it.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        return self.collate_fn(batch) if batch else None
