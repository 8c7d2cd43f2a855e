"""Data parallel training: DDP (bucketed, overlapped all-reduce), DataParallel, SyncBatchNorm."""

from __future__ import annotations

from phalanx.data_parallel.ddp import DistributedDataParallel
from phalanx.data_parallel.dp import DataParallel
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.sync_bn import SyncBatchNorm
from phalanx.data_parallel.unused import UnusedParameterError

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "GradBucket",
    "SyncBatchNorm",
    "UnusedParameterError",
]
