"""Horovod's PyTorch API on phalanx: change ``import horovod.torch as hvd`` to
``import phalanx.horovod as hvd`` and launch with ``phalanx run`` instead of ``horovodrun``.

Horovod's own ``test/parallel/test_torch.py`` runs against this package on two CPU ranks
(``tools/peer_suites/horovod_suite.py``). As in Horovod, operations are matched across ranks by
``name`` (unnamed ones by call order) in a negotiation round (``controller.py``): ranks that
disagree on shape, dtype, root or operation get a ``RuntimeError`` on every rank; a name still in
flight raises ``ValueError``; ``join()`` takes part in the others' all-reduces (also a
``DistributedOptimizer``'s) with neutral values; int16 travels widened. ``DistributedOptimizer``
averages gradients with the same bucketed, overlapped all-reduce engine as
``phalanx.DistributedDataParallel``. Differences from Horovod, all deliberate:

* negotiation runs in the calling thread, not a background thread: an ``*_async`` call returns
  once every rank of the process set has reached *an* operation (its collective then runs in the
  background), and a name stays in flight until its handle is synchronized;
* ``broadcast_object`` / ``allgather_object`` never unpickle: they carry plain data and tensors;
* ``Adasum`` and the timeline are not supported; ``init(comm=...)`` is not (use
  ``add_process_set`` after ``init()``), and ``add_process_set`` needs no
  ``HOROVOD_DYNAMIC_PROCESS_SETS``;
* ``join()`` covers the global process set; a ``DistributedOptimizer`` shares the wrapped
  optimizer's state instead of starting empty, and all-gathers sparse gradients at
  ``synchronize()`` (their slot in the bucketed all-reduce carries zeros).
"""

from __future__ import annotations

from typing import Any

from phalanx.horovod.allgather import (
    allgather,
    allgather_async,
    grouped_allgather,
    grouped_allgather_async,
)
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
from phalanx.horovod.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
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
from phalanx.horovod.optimizer import DistributedOptimizer
from phalanx.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from phalanx.horovod.reducescatter import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from phalanx.horovod.sparse import sparse_allreduce_async
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
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
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
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
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
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "synchronize",
]


def __getattr__(name: str) -> Any:
    # SyncBatchNorm is imported on first use: ``import phalanx.horovod`` never depends on it.
    if name == "SyncBatchNorm":
        from phalanx.data_parallel.sync_bn import SyncBatchNorm

        return SyncBatchNorm
    raise AttributeError(f"module 'phalanx.horovod' has no attribute {name!r}")
