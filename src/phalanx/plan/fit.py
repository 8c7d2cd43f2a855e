"""Which strategy fits a device: per-device totals and the recommendation (pure functions).

Preference order, least communication first (ZeRO paper, §7): DDP, ZeRO-1 and ZeRO-2 move 2Ψ
elements per rank per step, ZeRO-3 moves 3Ψ (1.5x); among the 2Ψ strategies the one that
shards less is simpler and issues fewer collectives, so DDP < ZeRO-1 < ZeRO-2 < ZeRO-3.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.plan.memory import StrategyEstimate

__all__ = ["PREFERENCE", "Recommendation", "parse_size", "recommend"]

PREFERENCE = ("ddp", "zero1", "zero2", "zero3")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``"16GB"`` (10^9), ``"16GiB"`` (2^30), ``"512MB"``, ``"1.5e9"`` or ``"4096"``.

    Raises:
        ValueError: Not a positive size with one of the units B, KB, MB, GB, TB, KiB .. TiB.
    """
    match = _SIZE.fullmatch(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size such as 16GB, 16GiB, 512MB or a plain number of bytes"
        )
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
    if nbytes <= 0:
        raise ValueError(f"{text!r} must be a positive size")
    return nbytes


@dataclass(frozen=True)
class Recommendation:
    """The outcome of fitting the strategies into ``budget`` bytes per device."""

    strategy: str | None
    """The preferred strategy that fits, or None when none does."""
    needed: float
    """Bytes per device of ``strategy``; when none fits, of the smallest strategy."""
    budget: float
    """Bytes of memory per device."""
    smallest: str
    """The strategy with the least memory per device."""

    @property
    def shortfall(self) -> float:
        """Bytes by which the smallest strategy misses the budget (0 when one fits)."""
        return 0.0 if self.strategy is not None else self.needed - self.budget


def device_total(row: StrategyEstimate, activation_bytes: float) -> float:
    """Bytes per device: model states plus one micro-batch's activations."""
    return row.total + activation_bytes


def recommend(
    rows: Sequence[StrategyEstimate], activation_bytes: float, budget: float
) -> Recommendation:
    """The first strategy in :data:`PREFERENCE` whose states + activations fit ``budget``.

    Args:
        rows: One estimate per strategy (as :func:`phalanx.plan.estimate` returns them).
        activation_bytes: Activation bytes per device, the same under every strategy.
        budget: Bytes of memory per device.
    """
    if budget <= 0:
        raise ValueError(f"recommend: budget must be positive, got {budget}")
    if activation_bytes < 0:
        raise ValueError(f"recommend: activation_bytes must be >= 0, got {activation_bytes}")
    unknown = [r.strategy for r in rows if r.strategy not in PREFERENCE]
    if not rows or unknown:
        raise ValueError(
            f"recommend: rows must be strategies of {PREFERENCE}, got {unknown or rows}"
        )
    ordered = sorted(rows, key=lambda r: PREFERENCE.index(r.strategy))
    smallest = min(ordered, key=lambda r: device_total(r, activation_bytes))
    for row in ordered:
        if device_total(row, activation_bytes) <= budget:
            return Recommendation(
                row.strategy, device_total(row, activation_bytes), budget, smallest.strategy
            )
    return Recommendation(None, device_total(smallest, activation_bytes), budget, smallest.strategy)
