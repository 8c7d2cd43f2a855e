"""Memory and communication per strategy: estimates (pure functions) and measurements."""

from __future__ import annotations

from phalanx.plan.memory import StrategyEstimate, bytes_per_param, estimate
from phalanx.plan.report import MemoryReport, memory_report

__all__ = ["MemoryReport", "StrategyEstimate", "bytes_per_param", "estimate", "memory_report"]
