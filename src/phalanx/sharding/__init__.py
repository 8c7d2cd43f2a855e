"""Sharded data parallel (ZeRO): optimizer state and gradients (stages 1, 2), parameters (3).

What a rank holds of any sharded state is a list of :class:`Piece` records
(:mod:`phalanx.sharding.pieces`), the one form ZeRO-1/2, ZeRO-3, the mesh and checkpoints share.
"""

from __future__ import annotations

from phalanx.sharding.partition import Partition, partition
from phalanx.sharding.pieces import Piece, PieceReader, Sharded, ShardedState
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
