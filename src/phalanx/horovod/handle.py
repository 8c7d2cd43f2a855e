"""Handles of asynchronous operations: ``synchronize(handle)`` and ``poll(handle)``.

A handle owns the works of one operation and the step that turns their buffers into the result
(scaling, slicing, decompressing). :func:`synchronize` is its one wait site; waiting twice
returns the same result. Unlike Horovod, whose handles are integers and whose operations are
matched across ranks by name, phalanx issues each operation at once: every rank must start the
same operations in the same order (the usual ``torch.distributed`` rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handle", "poll", "synchronize"]


class Handle:
    """An operation in flight; pass it to :func:`synchronize` for the result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None

    def done(self) -> bool:
        """True when every underlying work has completed (``wait`` will not block)."""
        if self._finish is None:
            return True
        return all(_completed(w) for w in self._works)

    def wait(self) -> Any:
        """Block until the operation completes and return its result."""
        if self._finish is not None:
            for w in self._works:
                w.wait()
            finish, self._finish = self._finish, None
            self._works = []
            self._result = finish()
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
    """True if the operation has completed, so that :func:`synchronize` will not block."""
    if not isinstance(handle, Handle):
        raise TypeError(
            f"poll() takes a handle returned by an hvd.*_async function, got "
            f"{type(handle).__name__}"
        )
    return handle.done()
