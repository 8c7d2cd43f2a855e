"""Where everything lives in a group's shared segment: a pure plan of byte offsets.

One segment per process group::

    [control: a 512-byte block per rank]
    [parity 0: slot of rank 0 .. slot of rank n-1, result]
    [parity 1: slot of rank 0 .. slot of rank n-1, result]

A rank's control block holds its arrival counter (alone on its cache line; only that rank
writes it), a flag it sets when it gives up on the group after an error, one call
descriptor per parity, and the CPU it last arrived from (a hint for waiters: ``sync.py``). Slots and
results come in two parities: consecutive steps of the collectives alternate between them, so
a rank may fill its slot for the next step while a slow peer still reads the previous one
(``collectives.py`` says why that is safe).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DESCRIPTOR_WORDS", "Layout"]

CONTROL_BLOCK = 512
COUNTER_OFFSET = 0
FAILED_OFFSET = 64
DESCRIPTOR_OFFSET = 128
DESCRIPTOR_WORDS = 16
CPU_OFFSET = 384
PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets in the segment of a group of ``world_size`` ranks."""

    world_size: int
    slot_bytes: int

    @property
    def control_bytes(self) -> int:
        return _round_up(self.world_size * CONTROL_BLOCK, PAGE)

    @property
    def total_bytes(self) -> int:
        return self.control_bytes + 2 * (self.world_size + 1) * self.slot_bytes

    def counter(self, rank: int) -> int:
        return rank * CONTROL_BLOCK + COUNTER_OFFSET

    def failed(self, rank: int) -> int:
        return rank * CONTROL_BLOCK + FAILED_OFFSET

    def cpu(self, rank: int) -> int:
        return rank * CONTROL_BLOCK + CPU_OFFSET

    def descriptor(self, rank: int, parity: int) -> int:
        return rank * CONTROL_BLOCK + DESCRIPTOR_OFFSET + parity * DESCRIPTOR_WORDS * 8

    def slot(self, parity: int, rank: int) -> int:
        return self.control_bytes + (parity * (self.world_size + 1) + rank) * self.slot_bytes

    def result(self, parity: int) -> int:
        return self.slot(parity, self.world_size)
