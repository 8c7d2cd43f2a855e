"""The two environment settings of the shared-memory backend, read when a group is made.

- ``PHALANX_SHM_SLOT_MB`` (default 1): MiB of each rank's staging slot; larger messages go in
  chunks of one slot. 1 MiB keeps a chunk in cache between its copy-in and its reduction.
- ``PHALANX_SHM_SPIN_US`` (default 50): microseconds a waiting rank spins (yielding its core)
  before it sleeps on a futex. 0 sleeps at once.
"""

from __future__ import annotations

import os

__all__ = ["slot_bytes_from_env", "spin_seconds_from_env"]

PAGE = 4096
SLOT_ENV = "PHALANX_SHM_SLOT_MB"
SPIN_ENV = "PHALANX_SHM_SPIN_US"
DEFAULT_SLOT_MB = 1.0
DEFAULT_SPIN_US = 50.0


def _env_number(name: str, default: float, low: float, high: float, meaning: str) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # NaN too
        raise ValueError(
            f"environment variable {name}={raw!r} must be a number in {low:g}..{high:g} "
            f"({meaning}); unset it for {default:g}"
        )
    return value


def slot_bytes_from_env() -> int:
    """Bytes of one rank's slot: ``PHALANX_SHM_SLOT_MB`` MiB rounded up to whole pages."""
    mib = _env_number(SLOT_ENV, DEFAULT_SLOT_MB, 0.0625, 4096, "MiB of each rank's slot")
    return -(-int(mib * 2**20) // PAGE) * PAGE


def spin_seconds_from_env() -> float:
    """Seconds a waiter spins before it sleeps: ``PHALANX_SHM_SPIN_US`` microseconds."""
    micros = _env_number(SPIN_ENV, DEFAULT_SPIN_US, 0, 1e6, "microseconds a waiter spins")
    return micros / 1e6
