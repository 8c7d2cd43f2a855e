"""Arrival counters in shared memory: a barrier that spins briefly, then sleeps in the kernel.

Each rank owns one 32-bit counter in the segment and is the only writer of it. Arriving at a
barrier is "write my data, then store counter + 1, then FUTEX_WAKE my counter"; waiting is
"until every peer's counter has reached mine: read it, spin a little, then FUTEX_WAIT on it".
No atomic read-modify-write is needed, which pure Python could not do.

Memory ordering. The data a rank copies into its slot must be visible to a peer that sees the
counter move. On x86-64 (TSO) stores become visible to other cores in program order and loads
are not reordered with older loads, so "data stores, then counter store" on one side and
"counter load, then data loads" on the other is enough; the compiler cannot reorder across the
opaque ctypes and torch calls between them. Weakly ordered machines (aarch64, POWER) would need
a release fence before the counter store and an acquire fence after the counter load (C11
``atomic_store_explicit(memory_order_release)`` / ``atomic_load(memory_order_acquire)``), which
pure Python has no way to issue, so :func:`futex.available` refuses them.

A peer that does not arrive is told apart from a slow one: while it sleeps, a waiter checks the
peer's process (pid and start time, exchanged through the store at start-up) every 0.1 s, and
names it at once when it died, or after the group's timeout when it is alive but elsewhere.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable, Sequence

from phalanx.comm.shm.errors import PeerDiedError, ShmError, ShmTimeoutError
from phalanx.comm.shm.futex import futex_wait, futex_wake
from phalanx.comm.shm.layout import Layout

__all__ = ["Arrivals", "current_cpu", "process_start"]

_MASK = 0xFFFFFFFF
_HALF = 0x80000000
_SLICE_S = 0.1
_BUSY_S = 10e-6
_UNKNOWN_CPU = -1


def _cpu_reader() -> Callable[[], int]:
    """glibc's ``sched_getcpu`` (no system call: it reads the kernel's rseq area), if any."""
    fn = getattr(ctypes.CDLL(None), "sched_getcpu", None)
    if fn is None:
        return lambda: _UNKNOWN_CPU
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


current_cpu = _cpu_reader()


def process_start(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


class Arrivals:
    """This rank's view of every rank's arrival counter in a mapped segment."""

    def __init__(
        self,
        segment: mmap.mmap,
        layout: Layout,
        rank: int,
        timeout_s: float,
        spin_s: float,
        processes: Sequence[tuple[int, int]] | None,
    ) -> None:
        """``processes``: every rank's (pid, start time) to watch, None where not visible."""
        n = layout.world_size
        self._words = [ctypes.c_uint32.from_buffer(segment, layout.counter(r)) for r in range(n)]
        self._addresses = [ctypes.addressof(w) for w in self._words]
        self._failed = [ctypes.c_uint32.from_buffer(segment, layout.failed(r)) for r in range(n)]
        self._cpus = [ctypes.c_int32.from_buffer(segment, layout.cpu(r)) for r in range(n)]
        self._cpu = _UNKNOWN_CPU
        self._processes = processes
        self.rank = rank
        self.timeout_s = timeout_s
        """The group's timeout."""
        self.call_timeout_s: float | None = None
        """The running call's own timeout (torch's ``opts.timeout``), if it set one."""
        self._spin_s = spin_s
        self._peers = [r for r in range(n) if r != rank]
        self._count = 0

    def release(self) -> None:
        """Drop the ctypes views, so the segment can be unmapped."""
        self._words, self._failed, self._cpus = [], [], []

    def fail(self) -> None:
        """Tell the peers that this rank gave up on the group (it raised a timeout or the like)."""
        self._failed[self.rank].value = 1
        futex_wake(self._addresses[self.rank])

    def barrier(self, what: Callable[[], str]) -> None:
        """Arrive, then wait until every rank has arrived as often as this one.

        ``what`` names the operation for an error ("shm all_reduce #12 ...").
        """
        self._count = (self._count + 1) & _MASK
        self._cpu = self._cpus[self.rank].value = current_cpu()
        self._words[self.rank].value = self._count
        futex_wake(self._addresses[self.rank])
        deadline = time.monotonic() + (self.call_timeout_s or self.timeout_s)
        for peer in self._peers:
            self._wait_for(peer, deadline, what)
        self._check_failed(what)

    def _check_failed(self, what: Callable[[], str]) -> None:
        # A peer that gave up may have arrived before it did; its data may be stale, so no
        # rank completes a call that a peer abandoned.
        for peer in self._peers:
            if self._failed[peer].value:
                missing = [p for p in self._peers if not self._failed[p].value]
                missing = [p for p in missing if not self._reached(p)]
                also = (
                    f"; rank(s) {missing} had not arrived at this call either (stopped, stuck "
                    f"or dead: most likely what rank {peer} gave up on)"
                    if missing
                    else ""
                )
                raise ShmError(
                    f"{what()}: rank {peer} gave up on this group after an error of its own "
                    f"(see that rank's log: a timeout or a dead peer){also}; the group cannot "
                    "continue: destroy it, or restart the job"
                )

    def _reached(self, peer: int) -> bool:
        return (self._words[peer].value - self._count) & _MASK < _HALF

    def _wait_for(self, peer: int, deadline: float, what: Callable[[], str]) -> None:
        if self._reached(peer):
            return
        # Spin: a few microseconds without a system call (a peer running on another core
        # arrives within them, and a syscall is where a loaded kernel hands the core to
        # another job), unless the peer last arrived from this very core; then yielding the
        # core: with more runnable threads than cores (two ranks and their worker threads on
        # two busy cores) the peer may need this core.
        start = time.perf_counter()
        same_core = self._cpus[peer].value == self._cpu != _UNKNOWN_CPU
        busy = 0.0 if same_core else min(self._spin_s, _BUSY_S)
        busy_until, spin_until = start + busy, start + self._spin_s
        while time.perf_counter() < busy_until:
            if self._reached(peer):
                return
        while time.perf_counter() < spin_until:
            os.sched_yield()
            if self._reached(peer):
                return
        word = self._words[peer]
        while True:
            seen = word.value
            if (seen - self._count) & _MASK < _HALF:
                return
            self._check_failed(what)
            now = time.monotonic()
            if now >= deadline:
                self._timed_out(what)
            futex_wait(self._addresses[peer], seen, min(_SLICE_S, deadline - now))
            if not self._reached(peer) and not self._alive(peer):
                raise PeerDiedError(
                    f"{what()}: rank {peer} (pid {self._pid(peer)}) died before it "
                    "arrived; the group cannot continue: restart the job (phalanx run "
                    "--max-restarts N restarts it for you) and look at that rank's log"
                )

    def _pid(self, peer: int) -> int:
        return 0 if self._processes is None else self._processes[peer][0]

    def _alive(self, peer: int) -> bool:
        if self._processes is None:  # in another pid namespace: only the timeout tells
            return True
        pid, start = self._processes[peer]
        return process_start(pid) == start

    def _timed_out(self, what: Callable[[], str]) -> None:
        missing = [p for p in self._peers if not self._reached(p)]
        own = self.call_timeout_s is not None
        hint = "pass the call a longer timeout" if own else "raise timeout= in init_process_group"
        raise ShmTimeoutError(
            f"{what()}: timed out after {self.call_timeout_s or self.timeout_s:g} s "
            f"({'the call' if own else 'the group'}'s timeout) waiting for rank(s) {missing}, "
            "alive but not arriving: they are stuck in other work or called a different "
            f"collective (PHALANX_DEBUG=1 compares every call); if their work is that slow, {hint}"
        )
