"""A progress bar on rank 0 only: tqdm on stderr there, a plain passthrough on the other ranks.

``for batch in progress(loader, desc="epoch 3"): ...; bar.set_metrics(loss=...)`` — N ranks
drawing N bars over each other on one terminal is unreadable, so only the main rank draws. When
stderr is not a terminal (a log file, a launcher's pipe) tqdm still works but redraws at most
every ``NON_TTY_INTERVAL`` seconds, so logs do not fill with carriage-return updates.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from phalanx.comm.group import world

__all__ = ["Progress", "progress"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NON_TTY_INTERVAL = 5.0
"""Seconds between redraws when stderr is not a terminal."""
TTY_INTERVAL = 0.1
"""Seconds between redraws on a terminal (tqdm's default)."""
_warned_missing = False


def _on_terminal() -> bool:
    """True when stderr ends on a terminal: directly, or through ``phalanx run``'s console."""
    return sys.stderr.isatty() or os.environ.get("PHALANX_CONSOLE") == "tty"


def _is_main() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return world().rank == 0


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _make_bar(iterable: Iterable[Any], desc: str | None, total: int | None, unit: str) -> Any:
    global _warned_missing
    try:
        from tqdm import tqdm
    except ImportError:
        if not _warned_missing:
            log.warning("tqdm is not installed: no progress bar (pip install tqdm)")
            _warned_missing = True
        return None
    tty = _on_terminal()
    interval = TTY_INTERVAL if tty else NON_TTY_INTERVAL
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    # The bar is updated by hand (not wrapped around the iterable) so that the last metrics are
    # set before it closes and draws its final line.
    return tqdm(
        desc=desc,
        total=total,
        unit=unit,
        file=sys.stderr,
        mininterval=interval,
        dynamic_ncols=tty,
    )


class Progress(Generic[T]):
    """An iterable over ``iterable`` that draws a bar when enabled; see :func:`progress`."""

    def __init__(
        self,
        iterable: Iterable[T],
        bar: Any,
        total: int | None = None,
        postfix_interval: float = TTY_INTERVAL,
    ) -> None:
        self._iterable = iterable
        self._total = total
        self._bar = bar
        self._interval = postfix_interval
        self._last = 0.0
        self._pending: dict[str, str] | None = None

    @property
    def enabled(self) -> bool:
        """True when this rank draws a bar."""
        return self._bar is not None

    def __iter__(self) -> Iterator[T]:
        if self._bar is None:
            yield from self._iterable
            return
        try:
            for item in self._iterable:
                yield item
                self._bar.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        if self._total is not None:
            return self._total
        return len(self._iterable)  # type: ignore[arg-type]

    def set_metrics(self, **metrics: Any) -> None:
        """Show ``metrics`` after the bar (e.g. ``loss=0.31, samples_per_s=812``).

        Cheap to call every step: the text is refreshed at most every redraw interval; the
        latest values are always shown when the bar closes. A no-op where no bar is drawn.
        """
        if self._bar is None:
            return
        self._pending = {k: _format(v) for k, v in metrics.items()}
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._flush()
            self._last = now

    def _flush(self) -> None:
        if self._pending is not None:
            self._bar.set_postfix(self._pending, refresh=False)
            self._pending = None

    def close(self) -> None:
        """Show the last metrics and close the bar (idempotent)."""
        if self._bar is not None:
            self._flush()
            self._bar.close()

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: int | None = None,
    enabled: bool | None = None,
    unit: str = "batch",
) -> Progress[T]:
    """Iterate ``iterable`` with a tqdm bar on stderr on rank 0, plainly elsewhere.

    Args:
        iterable: What to iterate (a DataLoader, a range...).
        desc: Text before the bar, e.g. ``"epoch 3"``.
        total: Number of items, when ``len(iterable)`` is unknown or wrong.
        enabled: Draw the bar (True) or not (False); None: only on global rank 0.
        unit: Name of one item in the rate (``"batch"`` -> ``batch/s``).

    Returns:
        A :class:`Progress`: iterate it, and call ``set_metrics(loss=...)`` to show values.
    """
    if enabled is None:
        enabled = _is_main()
    if not enabled:
        return Progress(iterable, None, total)
    bar = _make_bar(iterable, desc, total, unit)
    interval = TTY_INTERVAL if _on_terminal() else NON_TTY_INTERVAL
    return Progress(iterable, bar, total, interval)
