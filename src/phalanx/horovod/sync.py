"""``join()`` and ``barrier()``: points where every rank waits for the others.

``join()`` returns the rank that arrived last, as Horovod's does. Arrival order comes from an
atomic counter in the job's rendezvous store (a collective cannot tell who came last). Unlike
Horovod, a rank waiting in ``join()`` does not take part in the collectives of ranks still
training: give every rank the same number of batches (``DistributedSampler`` does), or use
``phalanx.DistributedDataParallel.join()`` for uneven inputs.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from phalanx.comm import collectives as c
from phalanx.comm.errors import CollectiveTimeoutError
from phalanx.horovod.basics import ProcessSet, check_group

__all__ = ["barrier", "join"]

_JOINS = 0  # join() calls so far: every rank calls join() the same number of times


def barrier(process_set: ProcessSet = None) -> None:
    """Block until every rank of ``process_set`` (default: all) has reached the barrier."""
    c.barrier(check_group(process_set))


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``; return the rank that called it last.

    Args:
        device: Accepted for compatibility with Horovod (its zero tensors' device).

    Returns:
        The global rank that joined last (the same on every rank).
    """
    global _JOINS
    check_group(None)
    store = distributed_c10d._get_default_store()
    prefix = f"phalanx/hvd-join/{_JOINS}/"
    _JOINS += 1
    me, size = dist.get_rank(), dist.get_world_size()
    store.set(f"{prefix}{me}", "1")
    if store.add(f"{prefix}count", 1) == size:
        store.set(f"{prefix}last", str(me))
    try:
        store.wait([f"{prefix}last"])
    except Exception as exc:  # the store's timeout, or a store that went away
        missing = [r for r in range(size) if not store.check([f"{prefix}{r}"])]
        raise CollectiveTimeoutError(
            f"[rank {me}] join(): ranks {missing} did not call join() within the store timeout "
            f"({_timeout(store)}); every rank must call join() once its data is exhausted"
        ) from exc
    return int(store.get(f"{prefix}last"))


def _timeout(store: dist.Store) -> str:
    limit = getattr(store, "timeout", None)
    return f"{limit.total_seconds():.0f} s" if isinstance(limit, timedelta) else "unknown"
