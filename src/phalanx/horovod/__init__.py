"""Horovod's PyTorch API on phalanx: change ``import horovod.torch as hvd`` to
``import phalanx.horovod as hvd`` and launch with ``phalanx run`` instead of ``horovodrun``.

``DistributedOptimizer`` averages gradients with the same bucketed, overlapped all-reduce engine
as ``phalanx.DistributedDataParallel``. Differences from Horovod, all deliberate:

* operations are matched across ranks by call order, not by ``name`` (every rank must issue the
  same collectives in the same order, as with ``torch.distributed``); handles are objects;
* ``broadcast_object`` / ``allgather_object`` never unpickle: they carry plain data and tensors;
* ``Adasum`` is not supported; a process set is a ``torch.distributed`` process group;
* ``join()`` shadows the ``DistributedOptimizer`` gradient all-reduces of ranks still training
  (zeros) and returns the last rank to arrive; other collectives issued inside the training
  loop cannot be shadowed.
"""

from __future__ import annotations

from typing import Any

from phalanx.horovod.allreduce import (
    ReduceOp,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
)
from phalanx.horovod.alltoall import alltoall, alltoall_async
from phalanx.horovod.basics import (
    HorovodInternalError,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from phalanx.horovod.compression import Compression
from phalanx.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from phalanx.horovod.grouped import (
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from phalanx.horovod.handle import Handle, poll, synchronize
from phalanx.horovod.ops import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
)
from phalanx.horovod.optimizer import DistributedOptimizer
from phalanx.horovod.sync import barrier, join

Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]


def __getattr__(name: str) -> Any:
    # SyncBatchNorm is imported on first use: ``import phalanx.horovod`` never depends on it.
    if name == "SyncBatchNorm":
        from phalanx.data_parallel.sync_bn import SyncBatchNorm

        return SyncBatchNorm
    raise AttributeError(f"module 'phalanx.horovod' has no attribute {name!r}")
