"""Hogwild: lock-free training of one shared-memory model by several processes.

``phalanx.hogwild.train(model, train_fn, num_processes, dataset=...)`` is seed 000's
``model.share_memory()`` + ``mp.Process`` loop made safe: spawn / forkserver only, a data shard
and a seed per process, one deadline, and the failing rank's traceback in the error.
Modules: ``plan`` (pure: shards, argument checks), ``train`` (processes).
"""

from __future__ import annotations

from phalanx.hogwild.plan import shard_indices
from phalanx.hogwild.train import train

__all__ = ["shard_indices", "train"]
