"""Linux ``futex`` wait and wake on a 32-bit word of shared memory, through ctypes.

The word lives in a ``MAP_SHARED`` segment mapped by several processes, so the shared (not
``_PRIVATE``) operations are used: the kernel keys a waiter by the page's inode and offset, and a
wake from any process that maps the page reaches it. ctypes releases the GIL for the length of
the call, so a rank blocked here lets its other threads run and burns no CPU.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable

from phalanx.comm.backends import shm_unusable

__all__ = ["available", "futex_wait", "futex_wake"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def available() -> str | None:
    """None when this machine can run the shared-memory backend, else the reason it cannot.

    Only Linux on x86-64 (``phalanx.comm.backends.shm_unusable``, the one rule): the backend
    publishes data with plain stores and relies on x86-64's total store order (see ``sync.py``);
    the futex syscall number is the x86-64 one.
    """
    return shm_unusable()


_syscall: Callable[..., int] | None = None
_NR = _SYS_FUTEX.get(platform.machine().lower(), -1)


def _libc_syscall() -> Callable[..., int]:
    global _syscall
    if _syscall is None:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint32,
        ]
        _syscall = fn
    return _syscall


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the word at ``address`` equals ``expected``, at most ``timeout_s`` seconds.

    Returns on a wake, on a timeout, on a signal, or at once when the word already differs
    (the kernel compares atomically, so a store and wake between the caller's read and this
    call is never lost). The caller re-reads the word in every case.
    """
    seconds = max(timeout_s, 0.0)
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    if _libc_syscall()(_NR, address, _FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def futex_wake(address: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on the word at ``address``."""
    if _libc_syscall()(_NR, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake failed: {os.strerror(err)}")
