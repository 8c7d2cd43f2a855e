"""This rank's last collective calls in a memory-mapped file that outlives the rank.

When gloo aborts a rank (SIGABRT on a shape mismatch) the survivors must say which collective
it died in; its progress in the store is up to half a second old. :class:`CallRing` writes each
call into a fixed slot of a small file as :func:`~phalanx.diagnostics.tracking.enter` records it (a
slice assignment into an ``mmap``, about a microsecond), and marks it done when it completes;
:func:`read_calls` turns the file of a live, stuck or dead rank on the same host back into
:class:`~phalanx.diagnostics.flight.Record` s.

Slot layout: one state byte (``E`` entered, ``D`` done, 0 being written), the end time as a
float64, then ``n \\t group \\t seq \\t op \\t shape \\t args \\t start \\t site`` in UTF-8, NUL
padded (a long call site is cut at the end of the slot; the call stays readable).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

from phalanx.diagnostics.flight import Record

__all__ = ["CallRing", "read_calls"]

SLOTS = 64
SLOT = 384
_TEXT = 9
_END = struct.Struct("<d")


class CallRing:
    """Writer of one rank's ring file (created, or reset, at ``path``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SLOTS * SLOT)
            self._mm = mmap.mmap(fd, SLOTS * SLOT)
        finally:
            os.close(fd)
        self._n = 0
        self._slot_of: dict[tuple[str, int], int] = {}

    def write(self, rec: Record) -> None:
        """Put ``rec`` (just entered) in the next slot."""
        n = self._n = self._n + 1
        off = (n % SLOTS) * SLOT
        text = (
            f"{n}\t{rec.group}\t{rec.seq}\t{rec.op}\t{rec.shape}\t{rec.args}\t{rec.start!r}\t"
            f"{rec.site}"
        ).encode()[: SLOT - _TEXT - 1]
        mm = self._mm
        mm[off] = 0
        mm[off + _TEXT : off + _TEXT + len(text) + 1] = text + b"\0"
        mm[off] = 69  # "E"
        slots = self._slot_of
        slots[(rec.group, rec.seq)] = n
        if len(slots) > 4 * SLOTS:  # async works nobody waits on: forget them
            # done() pops from a future's callback thread meanwhile: the oldest may be gone
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                slots.pop(next(iter(slots)))

    def done(self, group: str, seq: int, end: float) -> None:
        """Mark collective ``seq`` of ``group`` complete, if its slot still holds it."""
        n = self._slot_of.pop((group, seq), None)
        if n is not None and self._n - n < SLOTS:
            off = (n % SLOTS) * SLOT
            _END.pack_into(self._mm, off + 1, end)
            self._mm[off] = 68  # "D"

    def close(self) -> None:
        """Unmap the file (it stays on disk)."""
        self._mm.close()


def _parse(slot: bytes) -> tuple[int, Record] | None:
    state = slot[0]
    if state not in (68, 69):
        return None
    fields = slot[_TEXT:].split(b"\0", 1)[0].decode("utf-8", "replace").split("\t")
    if len(fields) != 8:
        return None
    n, group, seq, op, shape, args, start, site = fields
    try:
        end = _END.unpack_from(slot, 1)[0] if state == 68 else None
        rec = Record(group, int(seq), op, shape, site, float(start), end, args=args)
        return int(n), rec
    except ValueError:
        return None


def read_calls(path: str | os.PathLike[str]) -> list[Record] | None:
    """The calls in a ring file, oldest first; None when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    found = (_parse(data[i : i + SLOT]) for i in range(0, len(data) - SLOT + 1, SLOT))
    return [rec for _, rec in sorted((x for x in found if x is not None), key=lambda x: x[0])]
