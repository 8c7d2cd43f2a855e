"""``backend="shm"``: a c10d backend for CPU tensors whose ranks share one machine.

``import phalanx`` registers it (cheaply: the implementation loads when a group is made), so
``torch.distributed.init_process_group("shm")`` and ``phalanx.init_process_group("shm")`` work.
Collectives go through one POSIX shared-memory segment per group (``segment.py``), with arrival
counters that spin briefly, then sleep on a futex (``sync.py``), and reductions as torch ops
(``collectives.py``); calls run in issue order on a worker thread (``worker.py``). Point-to-point
and the other calls go to a gloo group made underneath (``backend.py``).

Where buffers that already live in shared memory (no copy-in) would plug in: a second segment per
group for persistent buffers (``segment.open_segment`` under another store key), whose views a
strategy allocates its buckets in; ``collectives.all_reduce`` would then skip the copy into the
slot when ``flat`` lies in it and read the peers' buffers there. Descriptors, barriers, the
ordered executor and the error paths stay as they are.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["BACKEND", "GLOO_P2P", "register"]

BACKEND = "shm"
GLOO_P2P = ("gloo", BACKEND)
"""Backends whose point-to-point calls are gloo's: CPU tensors, matched by tag."""


def _create(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    from phalanx.comm.shm.backend import ShmProcessGroup

    return ShmProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """Register ``"shm"`` with ``torch.distributed.Backend`` (once; later calls do nothing)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
