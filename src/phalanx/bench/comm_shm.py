"""``phalanx bench comm --shm``: gloo against the shared-memory backend, and memcpy, interleaved.

The ranks start with ``backend="shm"``; per operation and size the implementations are

- ``native``: gloo (a gloo group over the same ranks), the reference of ``vs_native``;
- ``shm``: the shm backend with plain tensors (copied into its slots and out, in chunks);
- ``shm-buffers``: the shm backend with the input in a shared buffer
  (``phalanx.comm.shm.shared_buffer``): no copy in or out (not for broadcast);
- ``memcpy``: one ``copy_`` of the same bytes on each rank, the memory-bandwidth yardstick
  (its busbw is its algbw); every row's ``vs_memcpy`` is its busbw over that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.shm import shared_buffer

__all__ = ["MEMCPY", "ShmBench", "shm_impls"]

MEMCPY = "memcpy"
"""The implementation name of the memcpy yardstick."""


class ShmBench:
    """What every size of an ``--shm`` run shares: a gloo group and one shared buffer."""

    def __init__(self, max_numel: int, dtype: torch.dtype) -> None:
        self.gloo = dist.new_group(backend="gloo")
        self.shared = shared_buffer(None, max_numel, dtype)


def shm_impls(
    op: str, big: torch.Tensor, small: torch.Tensor, bench: ShmBench
) -> dict[str, Callable[[], Any]]:
    """Zero-argument callables per implementation of ``op`` (``big``: the whole buffer)."""
    gloo = bench.gloo
    shared_big = bench.shared[: big.numel()]
    shared_small = bench.shared[: small.numel()]
    src, dst = torch.zeros_like(big), torch.empty_like(big)
    rs, ag = dist.reduce_scatter_tensor, dist.all_gather_into_tensor
    p = functools.partial
    table: dict[str, dict[str, Callable[[], Any]]] = {
        "all_reduce": {
            "native": p(dist.all_reduce, big, group=gloo),
            "shm": p(dist.all_reduce, big),
            "shm-buffers": p(dist.all_reduce, shared_big),
        },
        "reduce_scatter": {
            "native": p(rs, small, big, group=gloo),
            "shm": p(rs, small, big),
            "shm-buffers": p(rs, small, shared_big),
        },
        "all_gather": {
            "native": p(ag, big, small, group=gloo),
            "shm": p(ag, big, small),
            "shm-buffers": p(ag, big, shared_small),
        },
        "broadcast": {
            "native": p(dist.broadcast, big, 0, group=gloo),
            "shm": p(dist.broadcast, big, 0),
        },
    }
    return {**table[op], MEMCPY: p(dst.copy_, src)}
