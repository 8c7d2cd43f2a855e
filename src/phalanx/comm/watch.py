"""The wire's one hook: what each operation tells whoever watches the job.

The wire carries bytes and counts them (:func:`comm_stats`); it records nothing else itself.
Every collective calls :func:`enter` when it starts and :func:`leave` or :func:`failure` when it
ends; a point-to-point operation asks :func:`p2p` for its record when it is posted, then opens
it when this rank starts to wait and closes it when the wait ends (:mod:`phalanx.comm.work`);
``init_process_group`` and ``destroy_process_group`` call :func:`start` and :func:`stop`. All
of them go to the one :class:`Watcher` given to :func:`install`.

``import phalanx`` (which runs first for any ``phalanx.*`` import) gives
``phalanx.diagnostics.tracking`` (sequence numbers, flight records, the mismatch check, hang
reports and blame) to :func:`install_on_first_use`: it is imported when the wire first needs
it, so importing phalanx loads neither the diagnostics nor torch. The wire never imports the
diagnostics: they install themselves here, so the dependency points one way. Until one is
installed, nothing is recorded and a failed collective's error names the operation only.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.comm.errors import CollectiveError
from phalanx.comm.flags import TrackingFlags
from phalanx.comm.signed import SignedStore

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "P2PRecord",
    "Watcher",
    "comm_stats",
    "enter",
    "failure",
    "install",
    "install_on_first_use",
    "installed",
    "leave",
    "p2p",
    "reset_comm_stats",
    "start",
    "stop",
]

_CALLS: dict[str, int] = {}
_BYTES: dict[str, int] = {}


class P2PRecord(Protocol):
    """A send's or receive's record, as its work handle drives it (each called at most once)."""

    def open(self) -> None:
        """This rank starts to wait for the operation."""

    def close(self) -> None:
        """The wait is over (after :meth:`open`)."""


class Watcher(Protocol):
    """Who is told of every operation: ``phalanx.diagnostics.tracking`` (a module) is one."""

    def start(
        self,
        store: SignedStore | None,
        rank: int,
        world_size: int,
        validate: bool,
        timeout: timedelta,
        flags: TrackingFlags | None = None,
    ) -> None:
        """The default group exists (``store`` None: no store to publish progress on)."""

    def stop(self) -> None:
        """The default group is gone."""

    def enter(
        self,
        op: str,
        group: dist.ProcessGroup | None,
        tensor: torch.Tensor | None = None,
        *,
        reduce_op: Any = None,
        root: int | None = None,
        compare_shape: bool = True,
    ) -> int:
        """Collective ``op`` starts on this rank; returns its sequence number (-1: untracked)."""

    def leave(self, group: dist.ProcessGroup | None, seq: int) -> None:
        """Collective ``seq`` (from :meth:`enter`) completed on this rank."""

    def failure(
        self, op: str, seq: int, group: dist.ProcessGroup | None, exc: BaseException
    ) -> Exception:
        """The error to raise for the backend's failure ``exc`` of collective ``op`` #``seq``."""

    def p2p(self, op: str, peer: int, tensor: torch.Tensor | None, idle: bool) -> P2PRecord | None:
        """A record for a send or receive being posted now (None: nothing is recorded)."""


_watcher: Watcher | None = None
"""None until one is installed: nothing is recorded, and a failure's error names the operation."""
_load: Callable[[], Watcher] | None = None
"""What :func:`install_on_first_use` was given, until the wire first needs a watcher."""


def install(watcher: Watcher) -> None:
    """Tell ``watcher`` of every operation from now on (it replaces the one before)."""
    global _watcher, _load
    _watcher, _load = watcher, None


def install_on_first_use(load: Callable[[], Watcher]) -> None:
    """:func:`install` ``load()`` when an operation first needs a watcher (not if one is
    installed before then)."""
    global _load
    if _watcher is None:
        _load = load


def _current() -> Watcher | None:
    if _watcher is None and _load is not None:
        install(_load())
    return _watcher


def installed() -> Watcher | None:
    """The watcher the wire tells (``phalanx.diagnostics.tracking`` once phalanx is imported)."""
    return _current()


def comm_stats() -> dict[str, tuple[int, int]]:
    """``{op: (calls, bytes)}`` of the collectives this process issued through phalanx.

    Bytes are those of the tensor each call was given (the input of a reduction, the local
    shard of an all-gather), counted since the last :func:`reset_comm_stats`.
    """
    return {op: (n, _BYTES.get(op, 0)) for op, n in _CALLS.items()}


def reset_comm_stats() -> None:
    """Zero the counters of :func:`comm_stats`."""
    _CALLS.clear()
    _BYTES.clear()


def start(
    store: SignedStore | None,
    rank: int,
    world_size: int,
    validate: bool,
    timeout: timedelta,
    flags: TrackingFlags | None = None,
) -> None:
    """The default group exists: tell the watcher (``init_process_group`` calls it)."""
    if (watcher := _current()) is not None:
        watcher.start(store, rank, world_size, validate, timeout, flags)


def stop() -> None:
    """The default group is gone: tell the watcher (``destroy_process_group`` calls it)."""
    if _watcher is not None:
        _watcher.stop()


def enter(
    op: str,
    group: dist.ProcessGroup | None,
    tensor: torch.Tensor | None = None,
    *,
    reduce_op: Any = None,
    root: int | None = None,
    compare_shape: bool = True,
) -> int:
    """Count collective ``op`` and tell the watcher; returns its sequence number (-1: untracked).

    Raises:
        CollectiveMismatchError: the watcher found that the ranks' calls differ.
    """
    _CALLS[op] = _CALLS.get(op, 0) + 1
    if tensor is not None:
        _BYTES[op] = _BYTES.get(op, 0) + tensor.numel() * tensor.element_size()
    if (watcher := _current()) is None:
        return -1
    return watcher.enter(
        op, group, tensor, reduce_op=reduce_op, root=root, compare_shape=compare_shape
    )


def leave(group: dist.ProcessGroup | None, seq: int) -> None:
    """Collective ``seq`` (from :func:`enter`) completed on this rank."""
    if _watcher is not None:
        _watcher.leave(group, seq)


def failure(op: str, seq: int, group: dist.ProcessGroup | None, exc: BaseException) -> Exception:
    """The error to raise for the backend's failure ``exc`` of collective ``op`` #``seq``."""
    if (watcher := _current()) is None:
        return CollectiveError(f"{op} failed: {exc}")
    return watcher.failure(op, seq, group, exc)


def p2p(op: str, peer: int, tensor: torch.Tensor | None, idle: bool) -> P2PRecord | None:
    """The record of a send or receive posted now (None: nothing is recorded).

    Args:
        op: "send" or "recv".
        peer: The other global rank (-1: a receive from any rank).
        tensor: The tensor sent or received into.
        idle: The wait may legitimately be long: recorded, never reported as a hang.
    """
    return None if (watcher := _current()) is None else watcher.p2p(op, peer, tensor, idle)
