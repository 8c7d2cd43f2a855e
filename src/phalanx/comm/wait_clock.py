"""How long the training thread has been blocked on communication: one counter for every wait site.

A rank that is ahead of its peers does not compute less; it waits longer, inside a collective's
``wait()``, a blocking collective, a pipeline receive. Every place where phalanx blocks on
communication runs inside :func:`blocked`, which adds the time to one counter; :func:`waited`
reads it. The job's phase clock samples the counter at each phase boundary, so the wait is
attributed to the phase it happened in and subtracted from that phase's compute.

Only the waits of the thread that owns the clock count: the main thread, or the thread that
called :func:`claim` (the job's training thread), and code that thread's backward runs on
autograd's own threads (an accelerator's backward hooks). Waits on other threads (a parameter
server's heartbeats and serving threads) are not the training's, and neither is an *idle* wait
(``blocked(idle=True)``: a server waiting for its next request), wherever it runs.

Wait sites are nested (DDP's bucket future wraps a tracked work's ``wait()``): only the outermost
``blocked()`` of a thread decides and counts, so nesting never counts a wait twice. Waits that
phalanx does not see itself (torch's own DDP reducer, FSDP2) are added by their timing hooks with
:func:`add`, on behalf of the training thread (see ``phalanx.train.comm_timing``).

A tool that wants each wait, not only the total (``phalanx.diagnostics``' timeline draws them),
adds a watcher (:func:`add_watcher`): every counted wait is handed to it in seconds, on the
thread that counted it, right when the wait ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

import torch

__all__ = ["add", "add_watcher", "blocked", "claim", "remove_watcher", "waited"]

_lock = threading.Lock()
_total = [0.0]
_depth = threading.local()
_owner = [threading.main_thread().ident]
_watchers: list[tuple[Callable[[float], None], ...]] = [()]


def claim() -> None:
    """Make the calling thread the one whose waits count (the job's training thread)."""
    _owner[0] = threading.get_ident()


def _counts_here() -> bool:
    """The owner, or autograd running the owner's backward (graph task ids are per backward)."""
    return threading.get_ident() == _owner[0] or torch._C._current_graph_task_id() != -1


class _Blocked:
    """The context manager :func:`blocked` returns (a class: cheaper than a generator)."""

    __slots__ = ("_idle", "_start")

    def __init__(self, idle: bool) -> None:
        self._idle = idle

    def __enter__(self) -> None:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        counted = depth == 0 and not self._idle and _counts_here()
        self._start = time.perf_counter() if counted else -1.0

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _depth.n -= 1
        if self._start >= 0:
            add(time.perf_counter() - self._start)


def blocked(idle: bool = False) -> _Blocked:
    """``with blocked(): work.wait()`` counts the time spent inside as communication wait.

    Args:
        idle: A wait for work to arrive (a server's next request), never counted.
    """
    return _Blocked(idle)


def add(seconds: float) -> None:
    """Count ``seconds`` of the training thread's communication wait measured elsewhere."""
    with _lock:
        _total[0] += seconds
    for watch in _watchers[0]:
        watch(seconds)


def add_watcher(watch: Callable[[float], None]) -> None:
    """Hand every counted wait (its seconds, as it ends) to ``watch`` as well; keep it cheap."""
    _watchers[0] = (*_watchers[0], watch)


def remove_watcher(watch: Callable[[float], None]) -> None:
    """Undo :func:`add_watcher` (absent: nothing happens)."""
    _watchers[0] = tuple(w for w in _watchers[0] if w != watch)  # a bound method: equal, not same


def waited() -> float:
    """Seconds the training thread has been blocked on communication since the process started."""
    return _total[0]
