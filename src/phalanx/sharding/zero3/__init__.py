"""ZeRO stage 3 (fully sharded data parallel): parameters, gradients and optimizer state 1/N.

``FullyShardedDataParallel(model, wrap=Block)`` shards each ``Block`` as a unit of its own and
the remaining parameters as the root unit; build any ``torch.optim`` optimizer over its
``parameters()`` afterwards. Modules: ``plan`` (pure: units, padding), ``unit`` (flatten,
gather, free, reduce-scatter; the pieces each shard holds), ``runtime`` (hooks, prefetch, end
of backward), ``state_dict`` (full and sharded state dicts), ``fsdp`` (the public wrapper).
"""

from __future__ import annotations

from phalanx.sharding.zero3.fsdp import FullyShardedDataParallel
from phalanx.sharding.zero3.unit import FlatUnit

__all__ = ["FlatUnit", "FullyShardedDataParallel"]
