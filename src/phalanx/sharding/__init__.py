"""Sharded data parallel (ZeRO): optimizer-state sharding first; gradients and parameters next."""

from __future__ import annotations

from phalanx.sharding.partition import Partition, partition
from phalanx.sharding.zero1 import ZeroRedundancyOptimizer

__all__ = ["Partition", "ZeroRedundancyOptimizer", "partition"]
