"""Data loading for distributed training: sharding a dataset over ranks (for training, and
exactly once each for evaluation)."""

from __future__ import annotations

from phalanx.data.eval import EvalSampler
from phalanx.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "EvalSampler"]
