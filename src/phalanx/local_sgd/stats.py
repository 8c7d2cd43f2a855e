"""What a replica synchronisation sent and how long the training thread waited for it.

LocalSGD and DiLoCo exist to communicate rarely; a benchmark over a slow link compares what
each method hands to collectives and how long it blocks. :class:`SyncStats` counts both at
the one place each algorithm synchronises, so they need no sampling of the global counters
(``phalanx.comm_stats()`` counts every collective of the process, the job's own included).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncStats"]


@dataclass
class SyncStats:
    """Counters of one replica-synchronising algorithm on this rank."""

    syncs: int = 0
    """Synchronisations (averages, outer steps) done."""
    bytes_sent: int = 0
    """Bytes of the tensors this rank handed to all-reduces (the input of each reduction, as
    ``phalanx.comm_stats()`` counts them)."""
    sync_seconds: float = 0.0
    """Seconds the training thread spent inside the synchronisations (flattening, the
    all-reduces and the outer step): time not spent computing. With
    ``late_policy="weighted"`` it includes the wait for the last replica to join a round."""
    check_seconds: float = 0.0
    """``late_policy="weighted"``: seconds spent checking whether a round was announced (one
    store round trip per inner step)."""

    def add(self, sent: int, seconds: float, syncs: int = 1) -> None:
        """Count ``syncs`` synchronisations (streaming DiLoCo: fragments launched)."""
        self.syncs += syncs
        self.bytes_sent += sent
        self.sync_seconds += seconds
