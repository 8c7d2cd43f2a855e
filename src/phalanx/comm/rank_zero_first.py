"""``main_first``: rank 0 runs a block first, the others after it (seed 004's barrier pattern)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from phalanx._check import check_group

__all__ = ["main_first"]


@contextlib.contextmanager
def main_first(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Rank 0 runs the block first; the others wait, then run it (seed 004's barrier pattern).

    Typical use: download or preprocess a data set once, then let every rank read the cache.
    Without an initialised group the block simply runs.
    """
    check_group("group", group, where="main_first")
    if not dist.is_initialized():
        yield
        return
    first = dist.get_rank(group) == 0
    if not first:
        dist.barrier(group)
    try:
        yield
    finally:
        if first:
            dist.barrier(group)
