"""The bucket a communication hook sees: torch's ``GradBucket`` interface, in Python.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: it receives the bucket's
flat buffer holding this rank's *local* (not yet averaged) gradients and must return a future
whose value is a tensor of the same shape and dtype holding the **average** over the group.
The same contract as torch's DDP, so hooks written for torch (``fp16_compress_hook``,
``powerSGD_hook``) run unchanged on phalanx's engine, and phalanx's hooks run on torch's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradBucket", "check_comm_hook"]


class GradBucket:
    """One flat bucket of gradients, as handed to a communication hook."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position of the bucket; bucket 0 holds the last-registered parameters."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer of this rank's local gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter gradient views into :meth:`buffer`, shaped like the parameters."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds, in buffer order."""
        return self._parameters

    def is_last(self) -> bool:
        """True for the last bucket reduced in an iteration."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (same shape and dtype)."""
        self._buffer = buffer


def check_comm_hook(hook: Any) -> None:
    """Refuse a hook that is not callable or is annotated with other types (torch's checks).

    Annotations written as strings (``from __future__ import annotations``) are read by name.

    Raises:
        TypeError: ``hook`` is not callable.
        ValueError: its ``bucket`` or return annotation is not torch's (or phalanx's) type.
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. Got {type(hook).__name__}.")
    sig = inspect.signature(hook)
    bucket = sig.parameters.get("bucket")
    if bucket is not None and not _names(bucket.annotation, _BUCKET_TYPES, "GradBucket"):
        raise ValueError(
            f"Communication hook: bucket annotation should be dist.GradBucket. Got "
            f"{bucket.annotation!r}."
        )
    if not _names(sig.return_annotation, (torch.futures.Future[torch.Tensor],), "Future"):
        raise ValueError(
            f"Communication hook: return annotation should be "
            f"torch.futures.Future[torch.Tensor]. Got {sig.return_annotation!r}."
        )


_BUCKET_TYPES: tuple[Any, ...] = (dist.GradBucket, GradBucket, Any)


def _names(annotation: Any, allowed: tuple[Any, ...], word: str) -> bool:
    if annotation is inspect.Parameter.empty or any(annotation == a for a in allowed):
        return True
    return isinstance(annotation, str) and (word in annotation or annotation == "Any")
