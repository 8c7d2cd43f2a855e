"""Pure planning for Hogwild: which samples each process trains on, and argument checks.

No processes and no tensors here, so every rule is unit-testable in microseconds.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

__all__ = ["START_METHODS", "check_train_args", "shard_indices"]

START_METHODS = ("spawn", "forkserver")
"""Start methods that give each process a fresh interpreter (no inherited OpenMP pool)."""

_FORK_REFUSED = (
    "start_method='fork' is refused: a forked child inherits the parent's OpenMP / MKL thread "
    "pool in a locked state once the parent has run any tensor math, and the child's first "
    "parallel op then deadlocks. Use start_method='spawn' or 'forkserver' (the shared "
    "parameters reach the children through shared memory either way)."
)


def shard_indices(length: int, rank: int, num_processes: int) -> list[int]:
    """The sample indices process ``rank`` trains on: every ``num_processes``-th, from ``rank``.

    This is ``DistributedSampler(shuffle=False, drop_last=False)``'s strided split without the
    padding: Hogwild processes never wait for each other, so shards need not be equal and no
    sample is repeated. Shard sizes differ by at most one; together they cover each index once.

    Args:
        length: Number of samples in the data set.
        rank: This process's index, ``0 <= rank < num_processes``.
        num_processes: Number of Hogwild processes.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got length={length}")
    if not 0 <= rank < num_processes:
        raise ValueError(
            f"rank must be in [0, num_processes), got rank={rank}, num_processes={num_processes}"
        )
    return list(range(rank, length, num_processes))


def check_train_args(
    train_fn: Callable[..., Any],
    num_processes: int,
    start_method: str,
    num_threads: int,
    timeout: float | None,
) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the argument for a mistake in ``train()``'s."""
    if start_method == "fork":
        raise ValueError(_FORK_REFUSED)
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    for name, value in (("num_processes", num_processes), ("num_threads", num_threads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got timeout={timeout}")
    _check_picklable(train_fn)


def _check_picklable(train_fn: Callable[..., Any]) -> None:
    """Fail here, not in ``Process.start()``: spawn / forkserver pickle ``train_fn`` by name."""
    if not callable(train_fn):
        raise TypeError(f"train_fn must be callable, got {type(train_fn).__name__}")
    name = getattr(train_fn, "__qualname__", repr(train_fn))
    if "<lambda>" in name or "<locals>" in name:
        raise TypeError(
            _not_picklable(name, "it is a lambda or a function defined inside another function")
        )
    try:
        pickle.dumps(train_fn)
    except Exception as exc:  # pickle raises PicklingError, AttributeError or TypeError
        raise TypeError(_not_picklable(name, f"pickling it failed: {exc}")) from exc


def _not_picklable(name: str, why: str) -> str:
    return (
        f"train_fn={name} cannot be sent to a spawn / forkserver process: {why}. Define it "
        "at module level (def train_fn(rank, model, shard, *args): ...) in an importable module "
        "or in the script guarded by `if __name__ == '__main__':`."
    )
