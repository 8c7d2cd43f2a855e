"""The handle of an asynchronous operation: failures reported like the blocking calls', and
completion recorded for the hang detector however the handle is consumed.

One mechanism for collectives and point-to-point operations alike: a :class:`TrackedWork` wraps
torch's ``Work`` with an *entry*, the operation's flight record, kept by whoever watches the wire
(:mod:`phalanx.comm.watch`). A collective's record opens when it is launched (:func:`watch.enter`);
a point-to-point record (:class:`P2PEntry`) opens when this rank starts to wait for it
(``wait()``, or the return of a blocking call), because a receive posted ahead of need is not a
stuck rank until someone waits on it.

A collective's record closes when the backend completes the work, whoever consumes it: a
callback on the work's own future closes it (even for a handle nobody waits on), and so do
``wait()`` returning, ``get_future()``'s future (DDP's communication hooks) and
``is_completed()`` first saying True. A point-to-point record is open only while someone waits,
and the wait's end closes it (on gloo a send or receive has no future and completes only inside
``wait()``: its ``is_completed()`` stays False until then).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from phalanx.comm import wait_clock, watch

__all__ = ["CollectiveEntry", "Entry", "P2PEntry", "TrackedWork", "run_blocking"]


class Entry(Protocol):
    """One operation's flight record, as a work handle drives it."""

    closes_from_future: bool
    """Close the record from the work's own future (an open record that nobody may wait on)."""
    idle: bool
    """A wait for work to arrive: never a hang, never the training's communication wait."""

    def begin(self) -> None:
        """This rank starts waiting for the operation."""

    def end(self) -> None:
        """The operation is over: close its record (idempotent)."""

    def error(self, exc: RuntimeError) -> Exception:
        """The error to raise for the backend's failure ``exc``."""


class CollectiveEntry:
    """A collective's record, opened by :func:`watch.enter` at launch."""

    closes_from_future = True
    idle = False

    def __init__(self, op: str, seq: int, group: dist.ProcessGroup | None) -> None:
        self.op, self.seq, self.group = op, seq, group

    def begin(self) -> None:
        """Nothing: the record opened at launch."""

    def end(self) -> None:
        """Close the record."""
        watch.leave(self.group, self.seq)

    def error(self, exc: RuntimeError) -> Exception:
        """An error naming the ranks that never reached the collective (its record stays open)."""
        return watch.failure(self.op, self.seq, self.group, exc)


class P2PEntry:
    """A send's or receive's record on the ``p2p`` channel, opened when this rank waits for it.

    Args:
        op: "send" or "recv".
        peer: The other global rank (-1: a receive from any rank).
        tensor: The tensor sent or received into (its shape and dtype are recorded).
        idle: The wait may legitimately be long (see :mod:`phalanx.comm.p2p`): recorded, never
            reported as a hang.
        fail: Builds the error for a backend failure (naming this rank, the op and the peer).
    """

    closes_from_future = False  # open only while someone waits: the wait closes it

    def __init__(
        self,
        op: str,
        peer: int,
        tensor: torch.Tensor | None,
        idle: bool,
        fail: Callable[[RuntimeError], Exception],
    ) -> None:
        self.op, self.peer, self.idle, self._fail = op, peer, idle, fail
        self._record = watch.p2p(op, peer, tensor, idle)  # None: nothing recorded, nothing to pay
        self._opened = self._closed = False
        self._lock = threading.Lock()  # a future's callback may close it on another thread

    def begin(self) -> None:
        """Open the record (once)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self._record is None or self._opened or self._closed:
            return
        self._opened = True
        self._record.open()

    def end(self) -> None:
        """Close the record (opening it first if nobody waited: completed when first polled)."""
        with self._lock:
            self._open()
            if self._record is not None and self._opened and not self._closed:
                self._record.close()
            self._closed = True

    def error(self, exc: RuntimeError) -> Exception:
        """The failure closes the record: this rank no longer waits."""
        self.end()
        return self._fail(exc)


def _closer(entry: Entry) -> Callable[[torch.futures.Future[Any]], None]:
    def close(fut: torch.futures.Future[Any]) -> None:
        try:
            fut.value()
        except Exception:  # failed: the record stays open, wait() raises the failure
            return
        entry.end()

    return close


def run_blocking(entry: Entry, call: Callable[[], Any]) -> Any:
    """Run a blocking ``call`` as one wait of ``entry``; returns what it returns."""
    entry.begin()
    try:
        with wait_clock.blocked(entry.idle):
            result = call()
    except RuntimeError as exc:
        raise entry.error(exc) from exc
    entry.end()
    return result


class TrackedWork:
    """A torch ``Work`` whose ``wait()`` reports failures like the blocking calls do.

    However it is consumed (``wait()``, ``get_future()`` as DDP's communication hooks do, or
    ``is_completed()`` polling), its completion is recorded, so that the hang detector never
    takes a finished operation for a stuck one.
    """

    def __init__(self, work: Any, entry: Entry, post: Callable[[], None] | None = None) -> None:
        self._work, self._entry, self._post = work, entry, post
        self._future: torch.futures.Future[Any] | None = None
        if entry.closes_from_future:
            with contextlib.suppress(RuntimeError):  # a backend without futures: wait() closes
                work.get_future().then(_closer(entry))

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation completes; raise a phalanx error if it failed."""
        self._entry.begin()
        try:
            with wait_clock.blocked(self._entry.idle):
                done = self._work.wait() if timeout is None else self._work.wait(timeout)
        except RuntimeError as exc:
            raise self._entry.error(exc) from exc
        if done is False:  # a timeout that did not raise: still in flight
            return False
        self._entry.end()
        if self._future is not None:  # get_future() took the divide: wait until it ran
            self._future.wait()
        elif self._post is not None:
            post, self._post = self._post, None
            post()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """torch's future of the work; completing it records completion (and runs AVG's divide)."""
        future = self._work.get_future()  # gloo's sends and receives raise here: nothing changes
        entry, post = self._entry, self._post
        self._post = None
        entry.begin()

        def done(fut: torch.futures.Future[Any]) -> Any:
            entry.end()
            if post is not None:
                post()
            return fut.value()

        self._future = future.then(done)
        return self._future

    def is_completed(self) -> bool:
        """True once the operation completed (recorded as completed then)."""
        completed = bool(self._work.is_completed())
        if completed:
            self._entry.end()
        return completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
