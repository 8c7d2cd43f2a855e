"""The schedule LocalSGD and DiLoCo share: train alone, synchronise every ``every`` steps.

Each rank steps its own optimizer on its own batches; after every ``every``-th optimizer step
the replicas are brought back together by the algorithm's :meth:`PeriodicSync.sync` (an
average of the parameters, or DiLoCo's outer step). The count of steps since the last
synchronisation is part of the checkpoint, so a resumed job synchronises at the same steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from phalanx._check import check_int
from phalanx.local_sgd.replicas import Replica
from phalanx.local_sgd.stats import SyncStats

__all__ = ["DEFAULT_BUCKET_BYTES", "PeriodicSync"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Flat all-reduce buckets of at most this many bytes (DDP's default)."""


class PeriodicSync:
    """Counts optimizer steps and synchronises the replicas every ``every`` of them.

    Args:
        replica: This rank's parameters and buffers.
        group: The replicas' process group (None: every rank).
        every: Optimizer steps between synchronisations (H, >= 1).
        bucket_bytes: Cap of each flat all-reduce bucket.
    """

    def __init__(
        self,
        replica: Replica,
        group: dist.ProcessGroup | None,
        every: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        where = type(self).__name__
        self.every = check_int("every", every, min=1, where=where)
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes, min=1, where=where)
        self.replica = replica
        self.group = group
        self.steps = 0
        """Optimizer steps since the last synchronisation (checkpointed)."""
        self.stats = SyncStats()

    def after_step(self) -> bool:
        """Count one optimizer step; synchronise when it is the ``every``-th. True if it did."""
        self.steps += 1
        if self.steps < self.every:
            return False
        self._timed_sync()
        self.steps = 0
        return True

    def flush(self) -> None:
        """Synchronise now, off the schedule, if any step was taken since the last time: the
        end of training, so that every replica holds the same model to evaluate and export
        (LocalSGD's average, DiLoCo's θ after an outer step). Collective."""
        if self.steps:
            self._timed_sync()
            self.steps = 0

    def _timed_sync(self) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            sent = self.sync()
        self.stats.add(sent, time.perf_counter() - start)

    def sync(self) -> int:
        """Bring the replicas together; the bytes this rank handed to collectives."""
        raise NotImplementedError

    def finish(self) -> None:
        """Training is over: wait for communication still in flight (idempotent)."""

    def shared_state(self) -> dict[str, torch.Tensor]:
        """State equal on every rank that a checkpoint keeps once (by name)."""
        return {}

    def load_shared_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`shared_state` gave (from rank 0's checkpoint)."""
