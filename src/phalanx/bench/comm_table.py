"""The rows of ``phalanx bench comm`` and the table they print as."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.bench.comm_shm import MEMCPY

__all__ = ["GiB", "KiB", "MiB", "Row", "format_bytes", "format_table"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Row:
    """One (operation, size, implementation) line of the result."""

    op: str
    bytes: int
    impl: str
    p50_us: float
    p90_us: float
    algbw_gbps: float
    busbw_gbps: float
    vs_native: float
    """busbw over the native implementation's (same op and size), at p50."""
    vs_memcpy: float = float("nan")
    """busbw over the memcpy bandwidth of the same bytes (``--shm`` runs only)."""


def format_bytes(n: int) -> str:
    """``4096`` -> ``"4 KiB"``; sizes that are not whole units stay in bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def format_table(rows: Sequence[Row]) -> str:
    """The human table: one aligned line per row (text columns left, numbers right)."""
    head: tuple[str, ...] = ("op", "size", "impl", "p50 us", "p90 us", "algbw GB/s")
    head += ("busbw GB/s", "vs native")
    memcpy = any(r.impl == MEMCPY for r in rows)
    head += ("vs memcpy",) if memcpy else ()
    body = [
        (
            r.op,
            format_bytes(r.bytes),
            r.impl,
            f"{r.p50_us:.1f}",
            f"{r.p90_us:.1f}",
            f"{r.algbw_gbps:.3f}",
            f"{r.busbw_gbps:.3f}",
            f"{r.vs_native:.2f}x",
            *((f"{r.vs_memcpy:.2f}x",) if memcpy else ()),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def fmt(line: Sequence[str]) -> str:
        cells = zip(line, widths, strict=True)
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(cells))

    return "\n".join(fmt(line) for line in (head, *body))
