"""The handle of an asynchronous collective: failures reported like the blocking calls', and
completion recorded for the hang detector however the handle is consumed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import tracking, wait_clock

__all__ = ["TrackedWork"]


class TrackedWork:
    """A torch ``Work`` whose ``wait()`` reports failures like the blocking calls do.

    However it is consumed (``wait()``, ``get_future()`` as DDP's communication hooks do, or
    ``is_completed()`` polling), its completion is recorded, so that the hang detector never
    takes a finished collective for a stuck one.
    """

    def __init__(
        self,
        work: Any,
        op: str,
        seq: int,
        group: dist.ProcessGroup | None,
        post: Callable[[], None] | None,
    ) -> None:
        self._work, self._op, self._seq, self._group, self._post = work, op, seq, group, post
        self._future: torch.futures.Future[Any] | None = None

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation completes; raise a phalanx error if it failed."""
        try:
            with wait_clock.blocked():
                done = self._work.wait() if timeout is None else self._work.wait(timeout)
        except RuntimeError as exc:
            raise tracking.failure(self._op, self._seq, self._group, exc) from exc
        tracking.leave(self._group, self._seq)
        if self._future is not None:  # get_future() took the divide: wait until it ran
            self._future.wait()
        elif self._post is not None:
            post, self._post = self._post, None
            post()
        return bool(done) if done is not None else True

    def get_future(self) -> torch.futures.Future[Any]:
        """torch's future of the work; completing it records completion (and runs AVG's divide)."""
        group, seq, post = self._group, self._seq, self._post
        self._post = None

        def done(fut: torch.futures.Future[Any]) -> Any:
            tracking.leave(group, seq)
            if post is not None:
                post()
            return fut.value()

        self._future = self._work.get_future().then(done)
        return self._future

    def is_completed(self) -> bool:
        """True once the operation completed (recorded as completed then)."""
        completed = bool(self._work.is_completed())
        if completed:
            tracking.leave(self._group, self._seq)
        return completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
