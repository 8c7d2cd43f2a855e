"""The schedule LocalSGD and DiLoCo share: train alone, synchronise every ``every`` steps.

Each rank steps its own optimizer on its own batches; after every ``every``-th optimizer step
the replicas are brought back together by the algorithm's :meth:`PeriodicSync.sync` (an
average of the parameters, or DiLoCo's outer step). The count of steps since the last
synchronisation is part of the checkpoint, so a resumed job synchronises at the same steps.

``late_policy`` says what a late replica costs the others: ``"wait"`` (the default) syncs
after exactly ``every`` steps on every replica, reproducibly; ``"weighted"`` ends each round
when the first replica has taken ``every`` steps and weights the replicas by the steps they
took (:mod:`.late`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx._check import check_choice, check_instance, check_int
from phalanx.local_sgd.late import LATE_POLICIES, LateRounds, weights_of
from phalanx.local_sgd.pending_average import PendingAverage
from phalanx.local_sgd.replicas import Replica
from phalanx.local_sgd.stats import SyncStats

__all__ = ["DEFAULT_BUCKET_BYTES", "PeriodicSync"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Flat all-reduce buckets of at most this many bytes (DDP's default)."""


class PeriodicSync(ABC):
    """Counts optimizer steps and synchronises the replicas every ``every`` of them.

    Args:
        replica: This rank's parameters and buffers.
        group: The replicas' process group (None: every rank).
        every: Optimizer steps between synchronisations (H, >= 1).
        bucket_bytes: Cap of each flat all-reduce bucket.
        late_policy: "wait" (every replica syncs after exactly ``every`` steps) or
            "weighted" (a round ends when the first replica reaches ``every``; :mod:`.late`).
    """

    def __init__(
        self,
        replica: Replica,
        group: dist.ProcessGroup | None,
        every: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        late_policy: str = "wait",
    ) -> None:
        where = type(self).__name__
        fix = "build it with phalanx.local_sgd.replicas.Replica.of(model) (LocalSGD does)"
        check_instance("replica", replica, Replica, "a Replica", where=where, fix=fix)
        self.every = check_int("every", every, min=1, where=where)
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes, min=1, where=where)
        policy = check_choice("late_policy", late_policy, LATE_POLICIES, where=where)
        self.late = LateRounds(group) if policy == "weighted" else None
        """The rounds of ``late_policy="weighted"`` (None with "wait")."""
        self.replica = replica
        self.group = group
        self.steps = 0
        """Optimizer steps since the last synchronisation (checkpointed)."""
        self.stats = SyncStats()

    def after_step(self) -> bool:
        """Count one optimizer step; synchronise when it is the ``every``-th (or, weighted,
        when another replica announced the round). True if it did."""
        self.steps += 1
        late = self.late
        if late is None:
            if self.steps < self.every:
                return False
            self._timed_sync()
            self.steps = 0
            return True
        if self.steps < self.every:
            seen = late.announced()
            self.stats.check_seconds = late.check_seconds
            if not seen:
                return False
        else:
            late.announce()
        self._round(done=False)
        return True

    def flush(self) -> None:
        """Synchronise now, off the schedule, if any step was taken since the last time: the
        end of training, so that every replica holds the same model to evaluate and export
        (:meth:`final_sync`: the replicas' average). Collective.

        Weighted: join the others' rounds (weight 0 once this replica's steps are in) until
        every replica has flushed; the last round averages what is left. Once only."""
        if self.late is not None:
            self._drain(self.late)
        elif self.steps:
            self._timed(self.final_sync)
            self.steps = 0

    def _drain(self, late: LateRounds) -> None:
        if late.drained:
            return
        late.finished()
        while not late.drained:
            start = time.perf_counter()
            late.wait_announced()
            self.stats.add(0, time.perf_counter() - start, 0)
            late.drained = self._round(done=True)

    def _round(self, done: bool) -> bool:
        """One weighted round: exchange the step counts, average by them. True when every
        replica is done."""
        assert self.late is not None
        start = time.perf_counter()
        counts, all_done = self.late.exchange(self.steps, done)
        sent, syncs = 0, 0
        if sum(counts):
            sync = self.final_sync if all_done else self.sync
            with torch.no_grad():
                sent, syncs = sync(weights_of(counts)), 1
        self.steps = 0
        self.stats.add(sent, time.perf_counter() - start, syncs)
        return all_done

    def _timed_sync(self) -> None:
        self._timed(self.sync)

    def _timed(self, sync: Callable[[], int]) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            sent = sync()
        self.stats.add(sent, time.perf_counter() - start)

    def final_sync(self, weights: list[float] | None = None) -> int:
        """The synchronisation of :meth:`flush` (default: :meth:`sync`); the bytes sent."""
        return self.sync(weights)

    @abstractmethod
    def sync(self, weights: list[float] | None = None) -> int:
        """Bring the replicas together, weighted by ``weights`` (one per rank, summing to 1;
        None: the plain mean); the bytes this rank handed to collectives."""

    def weighted_mean(self, tensors: list[torch.Tensor], weights: list[float]) -> int:
        """Replace ``tensors`` by ``sum_r weights[r] * tensors_r`` (float32 sums, in buckets);
        the bytes sent."""
        pending = PendingAverage(tensors, self.group, "fp32", 1, self.bucket_bytes, weights)
        pending.wait()
        return pending.sent_bytes

    def finish(self) -> None:
        """Training is over: wait for communication still in flight (idempotent). Weighted:
        :meth:`flush` (the others' rounds need this replica until every one is done)."""
        if self.late is not None:
            self.flush()

    def shared_state(self) -> dict[str, torch.Tensor]:
        """State equal on every rank that a checkpoint keeps once (by name)."""
        return {}

    def load_shared_state(self, tensors: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Restore what :meth:`shared_state` gave (from rank 0's checkpoint); LocalSGD keeps
        nothing shared, so by default there is nothing to restore."""
