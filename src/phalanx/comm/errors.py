"""Errors raised by phalanx's communication layer. Each names the rank, the operation and a fix."""

from __future__ import annotations

__all__ = ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError"]


class CollectiveError(RuntimeError):
    """A collective or point-to-point operation failed on this rank."""


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives (op, shape, dtype, reduce op or root) at one step."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete in time; the message names the ranks that never reached it."""
