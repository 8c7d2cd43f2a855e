"""phalanx: distributed training for PyTorch — 2 processes or 200 machines as easy as one.

Importing phalanx computes no tensors (safe before forking worker processes).
"""

from __future__ import annotations

from torch.distributed import ReduceOp

from phalanx import hogwild
from phalanx.comm import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    World,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    comm_stats,
    destroy_process_group,
    gather,
    gather_object,
    init_process_group,
    irecv,
    is_initialized,
    is_main,
    isend,
    main_first,
    process_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    reset_comm_stats,
    scatter,
    scatter_object_list,
    send,
    world,
)
from phalanx.data import DistributedSampler
from phalanx.data_parallel import DataParallel, DistributedDataParallel, SyncBatchNorm
from phalanx.launch import SpawnError, spawn
from phalanx.model_parallel import split_across_devices
from phalanx.plan import MemoryReport, memory_report
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.train import Job

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataParallel",
    "DistributedDataParallel",
    "DistributedSampler",
    "FullyShardedDataParallel",
    "Job",
    "MemoryReport",
    "ReduceOp",
    "SpawnError",
    "SyncBatchNorm",
    "World",
    "ZeroRedundancyOptimizer",
    "__version__",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "comm_stats",
    "destroy_process_group",
    "gather",
    "gather_object",
    "hogwild",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_main",
    "isend",
    "main_first",
    "memory_report",
    "process_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reset_comm_stats",
    "scatter",
    "scatter_object_list",
    "send",
    "spawn",
    "split_across_devices",
    "world",
]
