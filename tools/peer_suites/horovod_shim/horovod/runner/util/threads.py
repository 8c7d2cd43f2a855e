"""``horovod.runner.util.threads.in_thread``: the one launcher helper Horovod's tests import."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(
    target: Callable[..., Any],
    args: tuple[Any, ...] = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Run ``target(*args)`` in a started background thread (exceptions swallowed if silent)."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}")

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
