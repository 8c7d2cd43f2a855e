"""Checksums of checkpoint files: crc32c as they are written, crc32c or sha256 as they are read.

A checkpoint's manifest records, for every file, its size and a digest of its bytes. New
checkpoints record crc32c (hardware-accelerated: ~10 GB/s against ~0.4 GB/s for sha256 on
the 2-core box of docs/checkpoints.md), computed on each chunk as it is written and again on the
bytes as they are read, so verification keeps up with memory bandwidth. Checkpoints written before
(``phalanx-checkpoint/1``) record sha256, which is still read and verified.

A tensor file's entry may also hold a crc32c per tensor, so a corrupt byte is named down to the
tensor holding it. crc32c detects corruption (every error burst up to 32 bits, and any other
error with probability 1 - 2**-32); it is no defence against a forger who can rewrite the
manifest as well, and neither is a sha256 stored beside the data it hashes.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Any, NamedTuple

import crc32c

__all__ = ["ALGORITHMS", "DEFAULT", "Digest", "TensorBytes", "crc32c_combine", "is_digest"]

DEFAULT = "crc32c"
"""The checksum new checkpoints record."""
ALGORITHMS = {"crc32c": re.compile(r"[0-9a-f]{8}"), "sha256": re.compile(r"[0-9a-f]{64}")}
"""Checksums a manifest may record -> the form of their hex digest."""


class TensorBytes(NamedTuple):
    """The bytes of one tensor, among the buffers of a file to write (named in its checksums)."""

    name: str
    data: memoryview


class Digest:
    """An incremental digest of ``algo`` (one of :data:`ALGORITHMS`)."""

    def __init__(self, algo: str = DEFAULT) -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"checksum algo={algo!r} is not one of {sorted(ALGORITHMS)}")
        self.algo = algo
        self._crc = 0
        self._sha = hashlib.sha256() if algo == "sha256" else None

    def update(self, data: Any) -> None:
        """Add the bytes of ``data`` (any contiguous buffer); releases the GIL on large ones."""
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = crc32c.crc32c(data, self._crc)

    def extend(self, crc: int, nbytes: int) -> None:
        """Add ``nbytes`` bytes whose own crc32c is ``crc``, without reading them again.

        The writer checksums a chunk once and adds that checksum to both the file's and the
        tensor's digest (:func:`crc32c_combine`), instead of running crc32c over it twice.
        """
        if self._sha is not None:
            raise ValueError("Digest.extend needs algo='crc32c', not sha256")
        self._crc = crc32c_combine(self._crc, crc, nbytes)

    def hexdigest(self) -> str:
        """The digest as lower-case hex (8 digits for crc32c, 64 for sha256)."""
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def is_digest(algo: object, digest: object) -> bool:
    """Whether ``digest`` is a hex digest of the known checksum ``algo``."""
    return (
        isinstance(algo, str)
        and algo in ALGORITHMS
        and isinstance(digest, str)
        and ALGORITHMS[algo].fullmatch(digest) is not None
    )


_POLY = 0x82F63B78
"""The Castagnoli polynomial, bit-reflected (crc32c processes bits least significant first)."""


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x) mod P(x)`` over GF(2), both reflected (bit 31 is x^0)."""
    m, product = 1 << 31, 0
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """``x^(2^k) mod P`` for k = 0..31 (reflected)."""
    out, p = [], 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _powers()


@lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``: what appending ``nbytes`` bytes multiplies a crc by."""
    p, k, n = 1 << 31, 3, nbytes  # x^0; bytes are 2^3 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``B``'s length.

    The method of zlib's ``crc32_combine`` (Mark Adler), for the Castagnoli polynomial; a few
    microseconds, so a chunk checksummed once can be added to several digests.
    """
    if len2 < 0:
        raise ValueError(f"crc32c_combine: len2 must be >= 0, got {len2}")
    return _multmodp(_shift(len2), crc1) ^ crc2 if len2 else crc1
