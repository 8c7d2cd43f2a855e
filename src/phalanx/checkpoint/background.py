"""The one checkpoint write in flight in this process (``save(async_=True)``).

``save(async_=True)`` stages the state (``staging.py``) and hands the rest of the save to
:func:`start`: writing the files, the store exchanges of ``sync.py`` and, on rank 0, the commit.
That work runs on one thread and uses only the rendezvous store (over its own connection), never
a collective: a collective there could interleave with the training thread's collectives on the
same process group. Ranks finishing at different times is what the store protocol already
handles: each waits on the store for the keys it needs.

There is one owner and one wait site. :func:`wait` (``phalanx.checkpoint.wait``) blocks until
the write is done and raises its error, as a :class:`CheckpointError` naming the checkpoint and,
through the original error, the file; the next ``save``, ``load`` and ``Job.close`` call it. A
second :func:`start` while one is in flight is a bug (asserted). The thread is not a daemon:
a script that ends without waiting still finishes its last checkpoint before the interpreter
exits.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  # its pool-stopping hook is registered first
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.checkpoint.errors import CheckpointError
from phalanx.comm import group

__all__ = ["in_flight", "running", "start", "wait"]

log = logging.getLogger(__name__)


@dataclass
class _Write:
    what: str
    thread: threading.Thread | None = None
    path: Path | None = None
    error: BaseException | None = None


NICE = 10
"""The background write's niceness (Linux, per thread). Where training keeps every core busy,
the write gets about a tenth of a core's time from the scheduler: measured on the 2-core box
with 2 training ranks and a 1 GB write (``phalanx bench checkpoint --mb 1000 --ranks 2,1
--rounds 3``), steps ran 13% slower while it wrote, durable after 4.5 s (DCP's thread: 113%,
2.7 s); at 19, 0% but durable after 30 s; at 5, 30% and 2.7 s. With a core to spare (1 rank)
all three cost training 2-3%."""
THREAD_NAME = "phalanx-ckpt-io-write"
"""The background write's thread. It writes its files one after another (``sections.parallel``
runs in line on threads of this prefix), at a lower priority (:data:`NICE`), queuing nothing
to disk early (``writeback.py``): it is to slow the training beside it as little as it can,
where a synchronous save, which holds the caller anyway, spreads its files over a few
threads."""

_CURRENT: _Write | None = None
_LOCK = threading.Lock()
_AT_EXIT_REGISTERED = False


def _run(write: _Write, work: Callable[[], Path]) -> None:
    _lower_priority()
    try:
        write.path = work()
    except BaseException as exc:  # kept for wait(); a thread has no one else to raise to
        write.error = exc


def _lower_priority() -> None:
    """Give this thread :data:`NICE`, so that where it and training want the same core,
    training mostly runs. Nothing where that fails (not Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def start(what: str, work: Callable[[], Path]) -> None:
    """Run ``work`` (the rest of a save, returning the committed directory) in the background.

    Args:
        what: Names the checkpoint in errors ("checkpoint step 12 in ckpt").
        work: Writes and commits; may use the store, never a collective.
    """
    global _CURRENT
    group.before_destroy(wait)  # phalanx.destroy_process_group waits for the write
    _register_exit_hook()
    with _LOCK:
        assert _CURRENT is None, f"{_CURRENT.what} is still in flight; wait() first"
        write = _Write(what)
        write.thread = threading.Thread(
            target=_run, args=(write, work), name=THREAD_NAME, daemon=False
        )
        _CURRENT = write
    write.thread.start()


def _register_exit_hook() -> None:
    """Have the interpreter's thread shutdown wait for the write (once per process).

    ``threading._register_atexit`` runs its hooks, newest first, when the main thread ends and
    before non-daemon threads are joined: ours (registered after ``concurrent.futures.thread``,
    imported at the top of this module, registered its own) runs before that module stops its
    pools. ``atexit`` would run too late.
    """
    global _AT_EXIT_REGISTERED
    hook = getattr(threading, "_register_atexit", None)
    if hook is not None and not _AT_EXIT_REGISTERED:
        with contextlib.suppress(RuntimeError):  # a save started during shutdown itself
            hook(_wait_at_exit)
        _AT_EXIT_REGISTERED = True


def _wait_at_exit() -> None:
    """The interpreter is exiting: commit the write in flight, or say loudly that it failed."""
    write = _CURRENT
    if write is None:
        return
    log.warning("waiting for %s before exiting (call Job.close() to wait earlier)", write.what)
    try:
        wait()
    except CheckpointError as exc:
        log.error("%s", exc)


def in_flight() -> bool:
    """Whether a background write has been started and not yet waited for."""
    return _CURRENT is not None


def running() -> bool:
    """Whether a background write is still writing (``wait`` would block)."""
    write = _CURRENT
    return write is not None and write.thread is not None and write.thread.is_alive()


def wait() -> Path | None:
    """Wait for the checkpoint write in flight, if any; return its committed directory.

    ``Job.close`` and ``phalanx.destroy_process_group`` call it: the write talks to the other
    ranks through the group's rendezvous store. Call it yourself before torch's own
    ``torch.distributed.destroy_process_group``.

    Returns:
        The committed checkpoint directory, or None when no write was in flight.

    Raises:
        CheckpointError: the background write failed; the message names the checkpoint and
            the error (an ``OSError`` names the file it could not write). The failed save left
            the previous checkpoint in force. The error is raised once; the next save starts
            afresh.
    """
    global _CURRENT
    write = _CURRENT
    if write is None:
        return None
    assert write.thread is not None
    write.thread.join()
    with _LOCK:
        _CURRENT = None
    if write.error is not None:
        err = write.error
        raise CheckpointError(
            f"the background write of {write.what} failed and was not committed (the "
            f"previous checkpoint, if any, is still in force): {type(err).__name__}: {err}"
        ) from err
    return write.path
