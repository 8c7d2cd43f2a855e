"""Buffers that already live in a group's shared memory, so collectives on them copy nothing.

``ShmProcessGroup.shared_buffer(numel, dtype)`` is collective: every rank of the group calls it
with the same arguments, in the same order. Each call makes one *region*: a segment (made like
the group's own, ``segment.open_segment``, under signed store keys of its own, with no name
left in ``/dev/shm`` once every rank mapped it) holding one page-aligned part per rank. A rank
gets a tensor over its own part; it can read every peer's part too. The regions go with the
group (``close``).

A collective whose tensor lies inside this rank's part of a region (:meth:`Regions.locate`,
by data pointer ranges) names the region and the byte offset in its call descriptor;
``zero_copy.py`` then reads the peers' tensors where they are.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from phalanx.comm.shm.ops import check_dtype
from phalanx.comm.shm.segment import SEGMENT_KEY, Meeting, open_segment
from phalanx.comm.signed import SignedStore

__all__ = ["Region", "Regions"]

_KEY = "phalanx_shm_buffer/"
_PAGE = 4096


def _said(nonce: str) -> Callable[[Any], str]:
    """Parse a rank's request, which must carry that rank's nonce of this group."""

    def parse(value: Any) -> str:
        if not (isinstance(value, list) and len(value) == 2 and value[0] == nonce):
            raise TypeError("not this group's request (no nonce of its rank)")
        if not isinstance(value[1], str):
            raise TypeError("the request is not a string")
        return value[1]

    return parse


@dataclass
class Region:
    """One allocation: the mapped segment and every rank's part of it, as bytes."""

    segment: mmap.mmap
    parts: list[torch.Tensor]
    """``parts[q]``: rank q's part (uint8), as mapped in this process."""
    start: int
    """Address of this rank's part."""
    nbytes: int
    """Bytes of this rank's part that its tensor covers."""
    path: str
    """Where the segment was in /dev/shm (unlinked once every rank mapped it)."""


class Regions:
    """The shared buffers of one group, numbered from 1 in allocation order."""

    def __init__(self, signed: SignedStore, met: Meeting, timeout: timedelta):
        self._signed, self._met, self._timeout = signed, met, timeout
        self.rank, self.world_size = met.rank, len(met.nonces)
        self._regions: list[Region] = []
        self._calls = 0  # every allocate, failed ones too: each under store keys of its own

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D tensor in this rank's part of a new region (collective)."""
        if not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"shared_buffer: numel must be a positive int, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"shared_buffer: dtype must be a torch.dtype, got {dtype!r}")
        check_dtype(dtype, "shared_buffer")
        nbytes = numel * dtype.itemsize
        part = -(-nbytes // _PAGE) * _PAGE
        self._calls += 1
        signed = self._signed.sub(f"{_KEY}{self._calls}/")
        n = self.world_size
        self._check_same(signed, f"{numel} x {str(dtype).removeprefix('torch.')}")
        path, segment = open_segment(signed.sub(SEGMENT_KEY), self._met, n * part, self._timeout)
        whole = torch.frombuffer(segment, dtype=torch.uint8)
        parts = [whole[q * part : (q + 1) * part] for q in range(n)]
        mine = parts[self.rank]
        self._regions.append(Region(segment, parts, mine.data_ptr(), nbytes, path))
        return mine[:nbytes].view(dtype)

    def _check_same(self, signed: SignedStore, asked: str) -> None:
        """Raise on every rank when the ranks asked for buffers of different sizes or dtypes
        (their parts would not line up: a read past a peer's part)."""
        nonce = self._met.nonces[self.rank]
        signed.put(f"asked/{self.rank}", [nonce, asked])
        every = []
        for r in range(self.world_size):
            said = signed.wait_get(f"asked/{r}", self._timeout, _said(self._met.nonces[r]))
            every.append(said)
        if len(set(every)) > 1:
            said = ", ".join(f"rank {r} {a}" for r, a in enumerate(every))
            raise ValueError(
                f"shared_buffer: every rank must ask for the same numel and dtype, but {said}"
            )

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        """(region number, byte offset in it) of a tensor inside this rank's part; (0, 0) if
        it lies in none (or is empty)."""
        if not self._regions or t.numel() == 0:
            return 0, 0
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        for number, region in enumerate(self._regions, start=1):
            if region.start <= lo and hi <= region.start + region.nbytes:
                return number, lo - region.start
        return 0, 0

    def peer(self, number: int, rank: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s tensor shaped like ``like`` (flat) at ``offset`` in region ``number``."""
        nbytes = like.numel() * like.element_size()
        return self._regions[number - 1].parts[rank][offset : offset + nbytes].view(like.dtype)

    @property
    def paths(self) -> list[str]:
        """Where each region's segment was in /dev/shm (all unlinked by now)."""
        return [r.path for r in self._regions]

    def close(self) -> None:
        """Unmap every region (a mapping still viewed by a tensor goes with the process)."""
        regions, self._regions = self._regions, []
        for region in regions:
            region.parts.clear()
            with contextlib.suppress(BufferError):
                region.segment.close()
