"""Handles of asynchronous operations: ``synchronize(handle)`` and ``poll(handle)``.

A handle is in one of three states. *Deferred*: the other ranks have not issued its operation
yet (Horovod matches by name, so they may issue it later); ``synchronize`` keeps negotiating
until they do. *Launched*: it owns the works of its collective and the step that turns their
buffers into the result (scaling, slicing, narrowing a widened dtype); ``synchronize`` is its
one wait site, and waiting twice returns the same result. *Failed*: the ranks disagreed (shape,
dtype, root ...) and ``synchronize`` raises the error every rank got. The operation's name is
in flight until ``synchronize`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handle", "poll", "synchronize"]


class Handle:
    """An operation in flight; pass it to :func:`synchronize` for the result."""

    def __init__(self, works: Sequence[Any] = (), finish: Callable[[], Any] | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._result: Any = None
        self._error: BaseException | None = None
        self._resolve: Callable[[Handle], None] | None = None
        self._release: Callable[[], Any] | None = None

    # ---- set by the controller ----------------------------------------------------------------
    def defer(self, resolve: Callable[[Handle], None]) -> None:
        """Mark as deferred; ``resolve(self)`` negotiates until it is launched or failed."""
        self._resolve = resolve

    def on_release(self, release: Callable[[], Any]) -> None:
        """Call ``release()`` once, when the first ``wait`` ends (frees the name)."""
        self._release = release

    def launch(self, works: Sequence[Any], finish: Callable[[], Any]) -> None:
        """The collective started: keep its works and the step that makes the result."""
        self._resolve = None
        self._works = [w for w in works if w is not None]
        self._finish = finish

    def fail(self, error: BaseException) -> None:
        """The operation cannot run (the ranks disagreed); ``wait`` raises ``error``."""
        self._resolve = None
        self._error = error
        self._finish = None

    @property
    def deferred(self) -> bool:
        """True while the other ranks have not issued this operation."""
        return self._resolve is not None

    # ---- user side ----------------------------------------------------------------------------
    def done(self) -> bool:
        """True when ``wait`` will not block (completed, failed, or finished already)."""
        if self._resolve is not None:
            return False
        if self._finish is None:
            return True
        return all(_completed(w) for w in self._works)

    def wait(self) -> Any:
        """Block until the operation completes and return its result (or raise its error)."""
        try:
            if self._resolve is not None:
                self._resolve(self)
            if self._error is not None:
                raise self._error
            if self._finish is not None:
                for w in self._works:
                    w.wait()
                finish, self._finish = self._finish, None
                self._works = []
                self._result = finish()
        finally:
            if self._resolve is None and self._release is not None:
                release, self._release = self._release, None
                release()
        return self._result

    def value(self) -> Any:
        """The result of a completed operation (``torch.futures.Future``'s name)."""
        return self.wait()


def _completed(work: Any) -> bool:
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if callable(is_completed) else True


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its result (a tensor, list or tuple)."""
    if not isinstance(handle, Handle):
        raise TypeError(
            f"synchronize() takes a handle returned by an hvd.*_async function, got "
            f"{type(handle).__name__}"
        )
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True if the operation has completed, so that :func:`synchronize` will not block.

    A deferred operation (the other ranks have not issued it yet) reports False.
    """
    if not isinstance(handle, Handle):
        raise TypeError(
            f"poll() takes a handle returned by an hvd.*_async function, got "
            f"{type(handle).__name__}"
        )
    return handle.done()
