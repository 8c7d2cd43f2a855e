"""The small record of a call that each rank publishes, so ranks that disagree are caught.

Before its first arrival of a collective, a rank writes (operation, dtype, element count, reduce
op, root, call number, and where its tensor lies: a shared buffer's number and the byte offset
in it, ``buffers.py``) into its control block. After the arrival every rank compares every
rank's record with its own; all ranks see the same records, so all of them raise the same
:class:`CollectiveMismatchError`, naming both sides, before any data is read. A mismatch of
size can therefore never read past a buffer, and the group stays usable after it. The offset is
not compared (each rank's tensor may sit elsewhere in its part); the buffer number is, so either
every rank's tensor is in the same shared buffer (the zero-copy path) or none is.

Each record also carries the line of code that issued the call and the line and signature of
the rank's previous call (``comm/call_sites.py``). Positions pair calls: one rank's extra
all_reduce meets the others' next one, and when the signatures agree no comparison of the call
itself can tell. The next call can: when a rank's call now is the very call (line and
signature) another rank made last time, while their previous lines differed, the previous call
was paired wrongly (:func:`find_shift`, the rule of ``phalanx/diagnostics/pairing.py``), and
every rank raises before this call reads any data. ``PHALANX_CALL_SITES=0`` turns the rule off
(rank-dependent code that shifts legitimately).
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

__all__ = ["KINDS", "Call", "check_same", "find_shift"]

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
_USED = 11
_FIXED = 7  # kind, dtype, numel, op, root, region, offset: alike for every call of a shape
_PER_CALL = struct.Struct("<4q")  # then the number, the site, the previous site and signature
_SIGNATURE_MASK = (1 << 63) - 1


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
    site: int = field(default=0, compare=False)
    """The line that issued it (``comm/call_sites.py``; 0: unknown)."""
    prev_site: int = field(default=0, compare=False)
    """The line of this rank's previous call on the group."""
    prev_signature: int = field(default=0, compare=False)
    """:attr:`signature` of this rank's previous call."""

    def words(self) -> tuple[int, ...]:
        dtype = -1 if self.dtype is None else DTYPES.index(self.dtype)
        fixed = (KINDS.index(self.kind), dtype, self.numel, self.op, self.root, self.region)
        per_call = (self.number, self.site, self.prev_site, self.prev_signature)
        return fixed + (self.offset,) + per_call + (0,) * (DESCRIPTOR_WORDS - _USED)

    @functools.cached_property
    def signature(self) -> int:
        """What must agree across ranks, but the number, as one int (alike in every process:
        a tuple of ints hashes without the per-process string salt)."""
        return hash(self.words()[:6]) & _SIGNATURE_MASK

    @classmethod
    def from_words(cls, words: tuple[int, ...]) -> Call:
        kind, dtype, numel, op, root, region, offset = words[:_FIXED]
        number, site, prev_site, prev_signature = words[_FIXED:_USED]
        return cls(
            kind=KINDS[kind] if 0 <= kind < len(KINDS) else f"unknown({kind})",
            dtype=DTYPES[dtype] if 0 <= dtype < len(DTYPES) else None,
            numel=numel,
            op=op,
            root=root,
            number=number,
            region=region,
            offset=offset,
            site=site,
            prev_site=prev_site,
            prev_signature=prev_signature,
        )

    def pack(self) -> bytes:
        return _FORMAT.pack(*self.words())

    @functools.cached_property
    def _around(self) -> tuple[bytes, bytes]:
        packed = self.pack()
        return packed[: 8 * _FIXED], packed[8 * _USED :]

    def pack_as(self, number: int, site: int = 0, prev_site: int = 0, prev_sig: int = 0) -> bytes:
        """``pack()`` of this call numbered ``number``, issued from ``site`` after a call from
        ``prev_site`` of signature ``prev_sig`` (a call reused for many packs its other words
        once)."""
        head, tail = self._around
        return head + _PER_CALL.pack(number, site, prev_site, prev_sig) + tail

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


def find_shift(calls: list[Call]) -> tuple[int, int] | None:
    """(rank a, rank b) where rank a's call now is rank b's previous call (same line and
    signature) while their previous lines differed: their previous calls were paired wrongly
    (a made an extra call, or b skipped one). None when no rank is shifted."""
    for a, now in enumerate(calls):
        if now.site == 0 or now.prev_site == 0:
            continue
        for b, other in enumerate(calls):
            if b == a or (other.prev_site, other.prev_signature) != (now.site, now.signature):
                continue
            if 0 != other.prev_site != now.prev_site:
                return a, b
    return None
