"""The one gradient bucket engine: ready counting, in-order launch, one wait site.

Every bucketed gradient synchronisation in phalanx runs on this engine: DDP's and Horovod's
all-reduce during backward (:mod:`phalanx.data_parallel.reducer`), ZeRO-1/2's reduce-scatter
into this rank's ranges (:mod:`phalanx.sharding.grad_reduce_scatter`) and the mesh's average
over data-parallel replicas (:mod:`phalanx.mesh.replica_average`). What differs between them is
only the collective, a parameter (Megatron-LM's ``param_and_grad_buffer`` is built the same way).

The engine knows how many gradients each bucket holds. Callers report gradients as they become
ready; once a bucket and every bucket before it are complete, they are launched **in bucket
order** (every rank must issue its collectives in the same order, whatever order its gradients
arrive in). A launched bucket's handle is waited for in exactly one place, :meth:`_wait`, which
hands it to the collective's ``complete``. With ``max_in_flight`` the oldest bucket is completed
before another is launched (ZeRO bounds its staging memory so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

__all__ = ["BucketEngine", "Collective"]

H = TypeVar("H")


class Collective(Protocol[H]):
    """What a bucket's communication does: start it, and finish it once it is waited for."""

    def launch(self, bucket: int) -> H | None:
        """Start bucket ``bucket``'s collective; its handle, or None if nothing was sent."""
        ...

    def complete(self, bucket: int, handle: H) -> None:
        """Wait for ``handle`` and take its result (the engine's only wait)."""
        ...


class BucketEngine(Generic[H]):
    """Counts each bucket's ready gradients and launches complete buckets in order."""

    def __init__(
        self, sizes: Sequence[int], collective: Collective[H], max_in_flight: int | None = None
    ) -> None:
        """Args:
        sizes: Gradients per bucket, in launch order (each >= 0).
        collective: Launches and completes one bucket's communication.
        max_in_flight: At most this many launched buckets not yet completed (None: no bound).
        """
        bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"sizes must be ints >= 0, got {list(sizes)}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be None or >= 1, got {max_in_flight}")
        self.sizes = list(sizes)
        self.collective = collective
        self.max_in_flight = max_in_flight
        self._flights: dict[int, H] = {}  # insertion order is launch order
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: nothing ready, nothing launched; handles in flight are
        forgotten (after an error, the iteration's results are discarded)."""
        self.pending = list(self.sizes)
        self.launched = 0
        """Buckets launched this iteration: exactly the first ``launched`` ones."""
        self._flights.clear()

    def in_flight(self) -> list[H]:
        """Handles launched and not yet completed, oldest first."""
        return list(self._flights.values())

    # ---- readiness ---------------------------------------------------------------------------
    def ready(self, bucket: int, count: int = 1) -> None:
        """``count`` more gradients of ``bucket`` are in; launch what is complete, in order."""
        left = self.pending[bucket] - count
        assert left >= 0, f"bucket {bucket}: {count} more ready than its {self.sizes[bucket]}"
        self.pending[bucket] = left
        if left == 0:
            self.launch_ready()

    def mark_complete(self, bucket: int) -> None:
        """Count ``bucket`` complete whatever is missing (unused or shadowed gradients)."""
        self.pending[bucket] = 0
        self.launch_ready()

    def launch_ready(self) -> None:
        """Launch, in order, every complete bucket whose predecessors are all launched."""
        while self.launched < len(self.sizes) and self.pending[self.launched] == 0:
            self._launch(self.launched)

    def launch_all(self) -> None:
        """Launch every bucket not launched yet, in order, complete or not (end of backward)."""
        while self.launched < len(self.sizes):
            self._launch(self.launched)

    def _launch(self, bucket: int) -> None:
        assert bucket == self.launched and bucket not in self._flights, (
            f"bucket {bucket} launched twice or out of order (next is {self.launched})"
        )
        if self.max_in_flight is not None:
            while len(self._flights) >= self.max_in_flight:
                self._wait(next(iter(self._flights)))
        self.launched += 1
        handle = self.collective.launch(bucket)
        if handle is not None:
            self._flights[bucket] = handle

    # ---- the one wait site -------------------------------------------------------------------
    def wait(self, bucket: int) -> None:
        """Complete ``bucket``'s collective if it is in flight."""
        if bucket in self._flights:
            self._wait(bucket)

    def wait_all(self) -> None:
        """Complete every collective in flight, in launch order."""
        while self._flights:
            self._wait(next(iter(self._flights)))

    def _wait(self, bucket: int) -> None:
        handle = self._flights.pop(bucket)
        self.collective.complete(bucket, handle)
