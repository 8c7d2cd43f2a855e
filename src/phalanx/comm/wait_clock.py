"""How long this process has been blocked on communication: one counter for every wait site.

A rank that is ahead of its peers does not compute less; it waits longer, inside a collective's
``wait()``, a blocking collective, a pipeline receive. Every place where phalanx blocks on
communication runs inside :func:`blocked`, which adds the time to one process-wide counter;
:func:`waited` reads it. The job's phase clock samples the counter at each phase boundary, so
the wait is attributed to the phase it happened in and subtracted from that phase's compute.

Wait sites are nested (DDP's bucket future wraps a tracked work's ``wait()``): only the outermost
``blocked()`` of a thread counts, so nesting never counts a wait twice. Waits that phalanx does
not see itself (torch's own DDP reducer, FSDP2) are added by their timing hooks with :func:`add`
(see ``phalanx.train.comm_timing``).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

__all__ = ["add", "blocked", "waited"]

_lock = threading.Lock()
_total = [0.0]
_depth = threading.local()


class _Blocked:
    """The context manager :func:`blocked` returns (a class: cheaper than a generator)."""

    __slots__ = ("_start",)

    def __enter__(self) -> None:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        self._start = time.perf_counter() if depth == 0 else -1.0

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _depth.n -= 1
        if self._start >= 0:
            add(time.perf_counter() - self._start)


def blocked() -> _Blocked:
    """``with blocked(): work.wait()`` counts the time spent inside as communication wait."""
    return _Blocked()


def add(seconds: float) -> None:
    """Count ``seconds`` of communication wait measured elsewhere (a timing hook)."""
    with _lock:
        _total[0] += seconds


def waited() -> float:
    """Seconds this process has been blocked on communication since it started."""
    return _total[0]
