"""The errors of live recovery."""

from __future__ import annotations

__all__ = ["Excluded", "JobFinished", "PeerLost", "RecoveryError"]


class RecoveryError(RuntimeError):
    """Live recovery could not form a new generation (names the member, rank and generation)."""


class Excluded(RecoveryError):
    """This process was declared dead and left out of the new generation.

    Its in-memory state is no longer the job's: the process should exit (non-zero), and the
    launcher starts a replacement for its slot, which joins and receives the live state.
    """


class JobFinished(RecoveryError):
    """A replacement arrived after the job's members finished: there is nothing to join."""


class PeerLost(RuntimeError):
    """A member of the current generation died while this one waited for it outside any
    collective (e.g. in a checkpoint's store waits): recover as after a failed collective."""
