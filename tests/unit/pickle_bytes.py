"""Hand-written pickle opcodes for the crafted-pickle tables (plain data and DCP metadata)."""

from __future__ import annotations

__all__ = ["get", "put", "shared"]


def put(i: int) -> bytes:
    """``LONG_BINPUT i``: memoize the top of the stack at index ``i``."""
    return b"r" + i.to_bytes(4, "little")


def get(i: int) -> bytes:
    """``LONG_BINGET i``: push memo entry ``i`` again (a second reference to it)."""
    return b"j" + i.to_bytes(4, "little")


def shared(levels: int, kind: str, base: int = 0) -> bytes:
    """A tuple or list whose every level holds the previous level twice: 2**levels values in
    about 12 bytes a level (memo indices from ``base``)."""
    first, step = (b")", b"%s%s\x86") if kind == "tuple" else (b"]", b"](%s%se")
    out = first + put(base) + b"0"
    for i in range(levels):
        out += step % (get(base + i), get(base + i)) + put(base + i + 1) + b"0"
    return out + get(base + levels)
