"""Sharded data parallel (ZeRO): optimizer state and gradients (stages 1, 2), parameters (3)."""

from __future__ import annotations

from phalanx.sharding.partition import Partition, partition
from phalanx.sharding.state import Piece, PieceReader, Sharded, ShardedState
from phalanx.sharding.zero import ZeroRedundancyOptimizer

__all__ = [
    "Partition",
    "Piece",
    "PieceReader",
    "Sharded",
    "ShardedState",
    "ZeroRedundancyOptimizer",
    "partition",
]
