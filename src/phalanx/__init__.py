"""phalanx: distributed training for PyTorch — 2 processes or 200 machines as easy as one.

Importing phalanx computes no tensors (safe before forking worker processes). Every subpackage is
an attribute (``phalanx.checkpoint.save(...)`` after ``import phalanx``); those that the names
below do not already import load on first use.

Logging: phalanx's modules log to ``logging.getLogger(__name__)``, under "phalanx", and add no
handlers, so the program's configuration and ``logging.getLogger("phalanx").setLevel(...)`` take
effect. Unconfigured, Python shows warnings on stderr; ``Job`` shows its info lines on rank 0
unless the program configured logging (:func:`phalanx.train.loop_helpers.configure_logging`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # loaded by __getattr__ on first use; imported here for type checkers only
    from phalanx import bench as bench
    from phalanx import checkpoint as checkpoint
    from phalanx import cli as cli
    from phalanx import datasets as datasets
    from phalanx import doctor as doctor
    from phalanx import horovod as horovod
    from phalanx import mesh as mesh
    from phalanx import models as models
    from phalanx import parameter_server as parameter_server
    from phalanx import pipeline as pipeline
    from phalanx import tensor_parallel as tensor_parallel
    from phalanx import testing as testing

__version__ = "0.1.0"

_SUBMODULES = (
    "bench",
    "checkpoint",
    "cli",
    "comm",
    "data",
    "data_parallel",
    "datasets",
    "doctor",
    "hogwild",
    "horovod",
    "launch",
    "mesh",
    "model_parallel",
    "models",
    "parameter_server",
    "pipeline",
    "plan",
    "sharding",
    "tensor_parallel",
    "testing",
    "train",
)
"""Every public module directly under phalanx, each an attribute of the package."""


def __getattr__(name: str) -> ModuleType:
    # PEP 562: runs only for names not already set, i.e. the subpackages not imported yet.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})


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
