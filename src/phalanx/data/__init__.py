"""Data loading for distributed training: sharding a dataset over ranks."""

from __future__ import annotations

from phalanx.data.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
