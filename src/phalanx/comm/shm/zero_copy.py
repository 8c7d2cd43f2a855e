"""The collectives on tensors that every rank keeps in a shared buffer: no slots, no chunks.

Each rank's tensor lies in its part of one region (``buffers.py``); after the first barrier
(which also compares the descriptors, so every rank is here) a rank reads the peers' tensors
in place, with torch ops that release the GIL:

- all_reduce: rank r reduces the r-th 1/n of every rank's tensor into the same range of its
  own, then writes that range into every peer's tensor; barrier. Only rank r ever reads or
  writes range r of any tensor during the call, so nothing races, and after the barrier
  nobody reads a peer's tensor any more: two barriers in all. Additions in rank order, as
  ``collectives.all_reduce`` (bit for bit gloo's at two ranks).
- reduce_scatter: rank r reduces block r of every rank's input straight into its output.
- all_gather: rank r copies every rank's input into its output.

Each ends with a barrier: a rank returns (and its caller may write its buffer again) only once
no peer still reads it (or, for all_reduce, writes it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phalanx.comm.shm.buffers import Regions
from phalanx.comm.shm.channel import Channel
from phalanx.comm.shm.collectives import share
from phalanx.comm.shm.ops import reduce_into

__all__ = ["all_gather", "all_reduce", "reduce_scatter"]


def _peers(ch: Channel, regions: Regions, flat: torch.Tensor) -> list[torch.Tensor]:
    """Open the call (first barrier) and return every rank's tensor, this rank's being ``flat``."""
    parity = ch.next_step()
    ch.first_barrier(parity)
    region, offsets = ch.current.region, ch.offsets(parity)
    return [
        flat if q == ch.rank else regions.peer(region, q, at, flat) for q, at in enumerate(offsets)
    ]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _reduce(out: torch.Tensor, inputs: Sequence[torch.Tensor], op: int) -> None:
    """``reduce_into``, also when ``out`` overlaps an input other than as the first two."""
    exact = [t.data_ptr() == out.data_ptr() and t.numel() == out.numel() for t in inputs]
    if any(
        _overlaps(out, t) and not (same and q < 2) for q, (t, same) in enumerate(zip(inputs, exact))
    ):
        tmp = torch.empty_like(out)
        reduce_into(tmp, inputs, op)
        out.copy_(tmp)
    else:  # elementwise: out may be inputs[0] or inputs[1]
        reduce_into(out, inputs, op)


def all_reduce(ch: Channel, regions: Regions, flat: torch.Tensor, op: int) -> None:
    views = _peers(ch, regions, flat)
    a, b = share(flat.numel(), ch.world_size, ch.rank)
    mine = flat[a:b]
    _reduce(mine, [v[a:b] for v in views], op)
    for q, view in enumerate(views):
        if q != ch.rank:
            view[a:b].copy_(mine)
    ch.barrier()


def reduce_scatter(
    ch: Channel, regions: Regions, out: torch.Tensor, flat: torch.Tensor, op: int
) -> None:
    """``out`` (k elements) = the reduction over ranks of block ``rank`` of ``flat`` (n * k)."""
    views = _peers(ch, regions, flat)
    k = out.numel()
    mine = slice(ch.rank * k, (ch.rank + 1) * k)
    _reduce(out, [v[mine] for v in views], op)
    ch.barrier()


def all_gather(
    ch: Channel, regions: Regions, outputs: Sequence[torch.Tensor], flat: torch.Tensor
) -> None:
    """``outputs[q]`` (flat, each like ``flat``) receives rank q's ``flat``."""
    views = _peers(ch, regions, flat)
    for out, view in zip(outputs, views):
        if out.data_ptr() != view.data_ptr():
            out.copy_(view)
    ch.barrier()
