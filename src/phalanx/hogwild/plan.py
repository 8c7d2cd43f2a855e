"""Pure planning for Hogwild: which samples each process trains on, and argument checks.

No processes and no tensors here, so every rule is unit-testable in microseconds.
"""

from __future__ import annotations

from typing import Any

from phalanx._check import (
    MODULE,
    check_choice,
    check_dataset,
    check_float,
    check_instance,
    check_int,
    check_picklable,
    checked,
    optional,
    rule,
)

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


def _start_method(name: str, value: Any, where: str) -> str:
    if value == "fork":
        raise ValueError(_FORK_REFUSED)
    return check_choice(name, value, START_METHODS, where=where)


_count = rule(check_int, min=1)

check_train_args = checked(
    "hogwild.train",
    model=MODULE,
    train_fn=rule(check_picklable),
    num_processes=_count,
    dataset=optional(rule(check_dataset)),
    args=rule(check_instance, types=tuple, what="a tuple of further arguments of train_fn"),
    start_method=_start_method,
    timeout=optional(rule(check_float, above=0, fix="or None to wait indefinitely")),
    seed=rule(check_int),
    num_threads=_count,
)
"""Decorates ``hogwild.train``: every argument checked before any process starts."""
