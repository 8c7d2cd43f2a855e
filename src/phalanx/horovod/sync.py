"""``join()`` and ``barrier()``: points where every rank waits for the others.

``join()`` returns the rank that arrived last, as Horovod's does. Arrival order comes from an
atomic counter in the job's rendezvous store (a collective cannot tell who came last). While it
waits, a joined rank takes part in the gradient all-reduces of the ranks still training, with
zero gradients (the average still divides by the world size, as in Horovod and torch's Join):
the last bucket of every ``DistributedOptimizer`` carries a "still training" flag, so the joined
rank learns from each round whether another one follows. Other collectives issued by the ranks
still training (a metric all-reduce inside the loop) cannot be shadowed: call them after
``join()``.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from phalanx.comm import collectives as c
from phalanx.comm.errors import CollectiveTimeoutError
from phalanx.horovod.basics import ProcessSet, check_group
from phalanx.horovod.grad_sync import LIVE

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
    if store.add(f"{prefix}count", 1) == size:  # arrival order, before any shadowing
        store.set(f"{prefix}last", str(me))
    _shadow_until_everyone_joined()
    try:
        store.wait([f"{prefix}last"])
    except Exception as exc:  # the store's timeout, or a store that went away
        missing = [r for r in range(size) if not store.check([f"{prefix}{r}"])]
        raise CollectiveTimeoutError(
            f"[rank {me}] join(): ranks {missing} did not call join() within the store timeout "
            f"({_timeout(store)}); every rank must call join() once its data is exhausted"
        ) from exc
    return int(store.get(f"{prefix}last"))


def _shadow_until_everyone_joined() -> None:
    syncs = list(LIVE)
    if not syncs:
        return
    while True:
        still_training = False
        for sync in syncs:
            still_training |= sync.reducer.shadow_iteration()
        if not still_training:
            return


def _timeout(store: dist.Store) -> str:
    limit = getattr(store, "timeout", None)
    return f"{limit.total_seconds():.0f} s" if isinstance(limit, timedelta) else "unknown"
