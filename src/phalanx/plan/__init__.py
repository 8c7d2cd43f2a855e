"""Memory and communication estimates per strategy (pure functions, no process group)."""

from __future__ import annotations

from phalanx.plan.memory import StrategyEstimate, bytes_per_param, estimate

__all__ = ["StrategyEstimate", "bytes_per_param", "estimate"]
