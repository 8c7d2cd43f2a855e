"""The "synchronise this backward" switch, one name on every engine: torch's
``require_backward_grad_sync``.

DDP, the ZeRO-1/2 optimizer, ZeRO-3's ``FullyShardedDataParallel``, the mesh's model and
Horovod's reducer all read it before a backward: False makes that backward accumulate its
gradients locally, without communication (gradient accumulation). :func:`sync_off` is their
``no_sync()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

__all__ = ["GradSyncSwitch", "sync_off"]


class GradSyncSwitch(Protocol):
    """Anything whose coming backward passes synchronise gradients unless switched off."""

    require_backward_grad_sync: bool


@contextlib.contextmanager
def sync_off(owner: GradSyncSwitch) -> Iterator[None]:
    """Backward passes inside accumulate locally; the previous value comes back in ``finally``."""
    previous = owner.require_backward_grad_sync
    owner.require_backward_grad_sync = False
    try:
        yield
    finally:
        owner.require_backward_grad_sync = previous
