"""``backend="shm"``: a c10d backend for CPU tensors whose ranks share one machine.

``import phalanx`` registers it (as soon as torch.distributed loads: ``comm/plugin.py``; the
implementation loads when a group is made), so ``torch.distributed.init_process_group("shm")``
and ``phalanx.init_process_group("shm")`` work.
Collectives go through one POSIX shared-memory segment per group (``segment.py``), with arrival
counters that spin briefly, then sleep on a futex (``sync.py``), and reductions as torch ops
(``collectives.py``); calls run in issue order on a worker thread (``worker.py``). Point-to-point
and the other calls go to a gloo group made underneath (``backend.py``).

Buffers that already live in shared memory: :func:`shared_buffer` gives a tensor in a segment
of its own (``buffers.py``); all_reduce, reduce_scatter_tensor and all_gather_into_tensor of
tensors that lie in such buffers on every rank read the peers' tensors in place, with no copy
into slots and no chunks (``zero_copy.py``). phalanx's DDP keeps its buckets there on an shm
group (:func:`gives_shared_buffers`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.comm.backends import SHM as BACKEND

__all__ = [
    "BACKEND",
    "GLOO_P2P",
    "create_group",
    "gives_shared_buffers",
    "shared_buffer",
]

GLOO_P2P = ("gloo", BACKEND)
"""Backends whose point-to-point calls are gloo's: CPU tensors, matched by tag."""


def create_group(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """A group on shared memory where every rank shares this machine, else a hierarchical one
    (``hierarchical.py``: shared memory inside each machine, gloo between them)."""
    from phalanx.comm.shm.backend import ShmProcessGroup
    from phalanx.comm.shm.hierarchical import HierarchicalProcessGroup
    from phalanx.comm.shm.segment import meet

    met = meet(dist.PrefixStore("phalanx_shm_meet/", store), rank, world_size, timeout)
    if met.one_host:
        return ShmProcessGroup(store, rank, world_size, timeout, met)  # met once, not twice
    return HierarchicalProcessGroup(store, rank, world_size, timeout, met.hosts)


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group() if group is None else group


def gives_shared_buffers(group: dist.ProcessGroup | None) -> bool:
    """Can ``group`` (None: the default group) give :func:`shared_buffer` s (backend 'shm')?"""
    return dist.is_initialized() and hasattr(_resolve(group), "shared_buffer")


def shared_buffer(
    group: dist.ProcessGroup | None, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor of ``numel`` elements in ``group``'s shared memory.

    Collective: every rank of the group calls it with the same arguments in the same order.
    all_reduce, reduce_scatter_tensor and all_gather_into_tensor of tensors (or slices) that lie
    in such buffers on every rank copy nothing in or out. Freed with the group.
    """
    pg = _resolve(group)
    if not gives_shared_buffers(pg):
        raise ValueError(
            f"shared_buffer: group={group!r} has backend {dist.get_backend(pg)!r}; shared "
            "buffers need a group made with backend='shm'"
        )
    return pg.shared_buffer(numel, dtype)  # type: ignore[attr-defined]
