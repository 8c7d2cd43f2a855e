"""The small record of a call that each rank publishes, so ranks that disagree are caught.

Before its first arrival of a collective, a rank writes (operation, dtype, element count, reduce
op, root, call number, and where its tensor lies: a shared buffer's number and the byte offset
in it, ``buffers.py``) into its control block. After the arrival every rank compares every
rank's record with its own; all ranks see the same records, so all of them raise the same
:class:`CollectiveMismatchError`, naming both sides, before any data is read. A mismatch of
size can therefore never read past a buffer, and the group stays usable after it. The offset is
not compared (each rank's tensor may sit elsewhere in its part); the buffer number is, so either
every rank's tensor is in the same shared buffer (the zero-copy path) or none is.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass, field

import torch

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm.layout import DESCRIPTOR_WORDS
from phalanx.comm.shm.ops import DTYPES, op_name

__all__ = ["KINDS", "Call", "check_same"]

KINDS = (
    "none",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce",
    "all_to_all",
)
_REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
_ROOTED = {"broadcast", "reduce"}
_FORMAT = struct.Struct(f"<{DESCRIPTOR_WORDS}q")
_USED = 8
_NUMBER = 5  # the word that changes from call to call
_NUMBER_FORMAT = struct.Struct("<q")


@dataclass(frozen=True)
class Call:
    """One rank's collective call, as compared across ranks."""

    kind: str
    dtype: torch.dtype | None = None
    numel: int = 0
    op: int = 0
    root: int = 0
    number: int = 0
    region: int = 0
    """The shared buffer (``buffers.Regions``, from 1) the tensor lies in; 0: none."""
    offset: int = field(default=0, compare=False)
    """Its byte offset in this rank's part of that buffer."""

    def words(self) -> tuple[int, ...]:
        dtype = -1 if self.dtype is None else DTYPES.index(self.dtype)
        head = (KINDS.index(self.kind), dtype, self.numel, self.op, self.root, self.number)
        return head + (self.region, self.offset) + (0,) * (DESCRIPTOR_WORDS - _USED)

    @classmethod
    def from_words(cls, words: tuple[int, ...]) -> Call:
        kind, dtype, numel, op, root, number, region, offset = words[:_USED]
        return cls(
            kind=KINDS[kind] if 0 <= kind < len(KINDS) else f"unknown({kind})",
            dtype=DTYPES[dtype] if 0 <= dtype < len(DTYPES) else None,
            numel=numel,
            op=op,
            root=root,
            number=number,
            region=region,
            offset=offset,
        )

    def pack(self) -> bytes:
        return _FORMAT.pack(*self.words())

    @functools.cached_property
    def _around_number(self) -> tuple[bytes, bytes]:
        packed = self.pack()
        return packed[: 8 * _NUMBER], packed[8 * (_NUMBER + 1) :]

    def pack_as(self, number: int) -> bytes:
        """``pack()`` of this call numbered ``number`` (a call reused with a new number packs
        its other words once)."""
        head, tail = self._around_number
        return head + _NUMBER_FORMAT.pack(number) + tail

    @classmethod
    def read(cls, segment: mmap.mmap, offset: int) -> Call:
        return cls.from_words(_FORMAT.unpack_from(segment, offset))

    def __str__(self) -> str:
        parts = [] if self.dtype is None else [str(self.dtype).removeprefix("torch.")]
        if self.kind != "barrier":
            parts.append(f"{self.numel} elements")
        if self.kind in _REDUCING:
            parts.append(f"op={op_name(self.op)}")
        if self.kind in _ROOTED:
            parts.append(f"root={self.root}")
        if self.region:
            parts.append(f"in shared buffer #{self.region}")
        return f"{self.kind}({', '.join(parts)}) as call #{self.number}"


def check_same(calls: list[Call], what: str) -> None:
    """Raise on every rank when the ranks' calls (indexed by rank) are not all alike."""
    first = calls[0]
    for rank, call in enumerate(calls):
        if call != first:
            raise CollectiveMismatchError(
                f"{what}: the ranks made different calls: rank 0 called {first}, rank {rank} "
                f"called {call}; every rank must make the same collective calls in the same "
                "order, with the same sizes, dtypes, reduce ops and roots"
            )
