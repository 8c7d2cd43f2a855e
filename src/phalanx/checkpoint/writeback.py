"""Start writing a file's dirty pages to disk while the rest of it is still being written.

A checkpoint file is written into the page cache and then fsync'd. Left alone, the kernel
writes the pages back at the ``fsync`` at the latest, and earlier only after its dirty-expiry
timer (about 30 s) or past its share of dirty memory, so most of the file's disk write sits
after its last ``write``. :class:`Writeback` asks
Linux to start writing each few MiB as soon as they are in the cache
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``: asynchronous, it only queues the I/O), so the
disk works while the next chunks are copied and checksummed, and the closing ``fsync`` has
little left to wait for. Measured on a 2-core CPU box: a 50 MB file's write + crc32c + fsync
took 36-43 ms instead of 51-68 ms.

Durability still comes from the ``fsync`` alone: this only moves work earlier. Where the call
does not exist (not Linux, or a libc without it) nothing happens. Nor on the thread of an
asynchronous save (``background.THREAD_NAME``): the I/O submission it triggers runs in the
kernel on whichever core is free, and beside training that is the training's core. Measured
with ``phalanx bench checkpoint`` (1 GB, 1 rank): training steps ran 8-18% slower during such
a write with it and 1.8% without, for a write durable after 1.02 s instead of 0.91 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

from phalanx.checkpoint.background import THREAD_NAME

__all__ = ["Writeback"]

_SYNC_FILE_RANGE_WRITE = 2
_EVERY = 4 * 1024 * 1024
"""Bytes written between two requests: large enough that the calls cost nothing."""


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _load()


class Writeback:
    """Tracks the bytes written to one file descriptor; every ~4 MiB, queues them to disk."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queued = 0
        self._written = 0
        self._early = threading.current_thread().name != THREAD_NAME

    def wrote(self, nbytes: int) -> None:
        """Record ``nbytes`` more written at the end of the file; queue them when enough."""
        self._written += nbytes
        if _SYNC_FILE_RANGE is None or not self._early or self._written - self._queued < _EVERY:
            return
        # An error here (a filesystem without support) is harmless: the fsync does the work.
        _SYNC_FILE_RANGE(
            self._fd, self._queued, self._written - self._queued, _SYNC_FILE_RANGE_WRITE
        )
        self._queued = self._written
