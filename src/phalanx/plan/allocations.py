"""What a piece of code allocates: bytes still held when it ends, and its peak, on any device.

torch keeps no statistics of its CPU allocator (``torch.cuda.max_memory_allocated`` has no CPU
twin, and the resident set counts the allocator's caching), but its profiler records every
allocation and free with its size when ``profile_memory=True``. Summing those records in time
order gives the bytes held at each moment: :func:`allocations` runs a function under the
profiler and returns the bytes it left allocated and the most it held at once, counted from
zero at its start (memory allocated before it is not counted, and frees of such memory lower
the count below zero).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.profiler import ProfilerActivity, profile

__all__ = ["Allocations", "allocations"]

T = TypeVar("T")


@dataclass(frozen=True)
class Allocations:
    """Bytes allocated by a function, counted from its start."""

    held: int
    """Allocated during the call and not freed by its end."""
    peak: int
    """The most held at any moment of the call."""


def allocations(fn: Callable[[], T]) -> tuple[T, Allocations]:
    """Run ``fn()`` under torch's memory profiler; its result and what it allocated."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # kineto's start and stop lines ("profiler_start"), not fn's output
        prof.start()
    try:
        result = fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    events: list[Any] = [] if results is None else list(results.events())
    records = [(e.start_ns(), int(e.nbytes())) for e in events if e.name() == "[memory]"]
    held = peak = 0
    for _, nbytes in sorted(records):
        held += nbytes
        peak = max(peak, held)
    return result, Allocations(held, peak)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null (the profiler's C++ log writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
