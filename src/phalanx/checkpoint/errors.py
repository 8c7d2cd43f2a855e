"""The errors of :mod:`phalanx.checkpoint`, in a module of their own: all others raise them."""

from __future__ import annotations

__all__ = ["CheckpointError", "ChecksumError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unsafe or does not fit what it is loaded into."""


class ChecksumError(CheckpointError):
    """A checkpoint file's size or checksum differs from what its manifest records."""
