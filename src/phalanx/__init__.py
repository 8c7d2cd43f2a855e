"""phalanx: distributed training for PyTorch — 2 processes or 200 machines as easy as one.

Importing phalanx computes no tensors (safe before forking worker processes) and imports no torch:
``phalanx run``'s agents never load it. Every ``phalanx.*`` import runs this file first, which
only arranges three things: the wire's hook loads ``phalanx.diagnostics.tracking`` when the
first operation needs it, the ``"shm"`` backend is registered with ``torch.distributed`` as soon
as that loads (``comm/plugin.py``), and the exit guard is installed. Every subpackage is an
attribute (``phalanx.checkpoint.save(...)`` after ``import phalanx``) and every name in
``__all__`` works as ``phalanx.Job`` or ``from phalanx import Job``; both load their module on
first use (``_lazy.py``).

What ``__all__`` exports, and why each name is there (``tests/unit/test_package.py`` checks this
list against ``__all__``); everything else stays importable from its subpackage:

- Drop-ins for torch's API, so one import line changes (the seeds' examples): the collectives
  ``init_process_group``, ``destroy_process_group``, ``is_initialized``, ``barrier``,
  ``broadcast``, ``all_reduce``, ``reduce``, ``all_gather``, ``all_gather_into_tensor``,
  ``gather``, ``scatter``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all``,
  ``all_to_all_single``, ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``,
  ``broadcast_object_list``, ``all_gather_object``, ``gather_object``, ``scatter_object_list``,
  ``ReduceOp``; the wrappers ``DistributedDataParallel``, ``DataParallel``, ``SyncBatchNorm``,
  ``DistributedSampler``, ``ZeroRedundancyOptimizer``, ``FullyShardedDataParallel``.
- This process's place in the job: ``world`` (returns a ``World``, exported for annotations),
  ``is_main``, ``main_first``, ``process_group``.
- The error every failed collective raises, to catch: ``CollectiveError`` (its kinds live in
  ``phalanx.comm``).
- Counting what went on the wire: ``comm_stats``, ``reset_comm_stats``.
- The job API: ``Job`` and its strategies ``DDP``, ``Zero``, ``Mesh``, ``PS`` (parameter
  servers: ``phalanx.parameter_server.ParameterServer`` is the low-level object it drives, hence
  the short name), ``LocalSGD``, ``DiLoCo`` and ``StreamingDiLoCo`` (slow links),
  ``Hogwild``, ``TorchDDP``, ``TorchZero1``, ``TorchFSDP`` (torch's baselines).
  Single-process ``"single"`` / ``"dp"``, the ``Strategy`` base class and ``register_strategy``
  are in ``phalanx.train``.
- Starting workers from Python: ``spawn``, ``SpawnError``.
- A model over the devices of one process: ``split_across_devices``.
- Planning: ``memory_report`` (its ``MemoryReport`` is in ``phalanx.plan``).
- Trading compute for memory: ``ActivationCheckpointing`` (``Job``'s option) and
  ``checkpoint_activations`` (any model).
- ``__version__``.

Logging: phalanx's modules log to ``logging.getLogger(__name__)``, under "phalanx", and add no
handlers, so the program's configuration and ``logging.getLogger("phalanx").setLevel(...)`` take
effect. Unconfigured, Python shows warnings on stderr; ``Job`` shows its info lines on rank 0
unless the program configured logging (:func:`phalanx.train.loop_helpers.configure_logging`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx import _lazy
from phalanx.comm import exit_guard as _exit_guard
from phalanx.comm import plugin as _plugin
from phalanx.comm import watch as _watch


def _tracking() -> _watch.Watcher:
    from phalanx.diagnostics import tracking

    return tracking


_watch.install_on_first_use(_tracking)  # the wire records nothing itself: tracking watches it
_plugin.register_when_loaded()  # torch.distributed.init_process_group("shm") works
_exit_guard.install()

if TYPE_CHECKING:  # loaded by __getattr__ on first use; imported here for type checkers only
    from torch.distributed import ReduceOp

    from phalanx import activation_checkpointing as activation_checkpointing
    from phalanx import bench as bench
    from phalanx import checkpoint as checkpoint
    from phalanx import cli as cli
    from phalanx import datasets as datasets
    from phalanx import diagnostics as diagnostics
    from phalanx import doctor as doctor
    from phalanx import horovod as horovod
    from phalanx import mesh as mesh
    from phalanx import models as models
    from phalanx import parameter_server as parameter_server
    from phalanx import pipeline as pipeline
    from phalanx import tensor_parallel as tensor_parallel
    from phalanx import testing as testing
    from phalanx.activation_checkpointing import (
        ActivationCheckpointing as ActivationCheckpointing,
    )
    from phalanx.activation_checkpointing import (
        checkpoint_activations as checkpoint_activations,
    )
    from phalanx.comm import (
        CollectiveError,
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
    from phalanx.data import DistributedSampler as DistributedSampler
    from phalanx.data_parallel import DataParallel as DataParallel
    from phalanx.data_parallel import DistributedDataParallel as DistributedDataParallel
    from phalanx.data_parallel import SyncBatchNorm as SyncBatchNorm
    from phalanx.launch import SpawnError as SpawnError
    from phalanx.launch.spawn import spawn as spawn
    from phalanx.model_parallel import split_across_devices as split_across_devices
    from phalanx.plan import memory_report as memory_report
    from phalanx.sharding import ZeroRedundancyOptimizer as ZeroRedundancyOptimizer
    from phalanx.sharding.zero3 import FullyShardedDataParallel as FullyShardedDataParallel
    from phalanx.train import DDP as DDP
    from phalanx.train import PS as PS
    from phalanx.train import DiLoCo as DiLoCo
    from phalanx.train import Hogwild as Hogwild
    from phalanx.train import Job as Job
    from phalanx.train import LocalSGD as LocalSGD
    from phalanx.train import Mesh as Mesh
    from phalanx.train import StreamingDiLoCo as StreamingDiLoCo
    from phalanx.train import TorchDDP as TorchDDP
    from phalanx.train import TorchFSDP as TorchFSDP
    from phalanx.train import TorchZero1 as TorchZero1
    from phalanx.train import Zero as Zero

__version__ = "0.1.0"

_SUBMODULES = (
    "activation_checkpointing",
    "bench",
    "checkpoint",
    "cli",
    "comm",
    "data",
    "data_parallel",
    "datasets",
    "diagnostics",
    "doctor",
    "hogwild",
    "horovod",
    "launch",
    "local_sgd",
    "mesh",
    "model_parallel",
    "models",
    "parameter_server",
    "pipeline",
    "plan",
    "precisions",
    "recovery",
    "sharding",
    "tensor_parallel",
    "testing",
    "train",
)
"""Every public module directly under phalanx, each an attribute of the package."""

_LAZY_NAMES = {
    "ReduceOp": "torch.distributed",
    "CollectiveError": "phalanx.comm",
    "World": "phalanx.comm",
    "all_gather": "phalanx.comm",
    "all_gather_into_tensor": "phalanx.comm",
    "all_gather_object": "phalanx.comm",
    "all_reduce": "phalanx.comm",
    "all_to_all": "phalanx.comm",
    "all_to_all_single": "phalanx.comm",
    "barrier": "phalanx.comm",
    "batch_isend_irecv": "phalanx.comm",
    "broadcast": "phalanx.comm",
    "broadcast_object_list": "phalanx.comm",
    "comm_stats": "phalanx.comm",
    "destroy_process_group": "phalanx.comm",
    "gather": "phalanx.comm",
    "gather_object": "phalanx.comm",
    "init_process_group": "phalanx.comm",
    "irecv": "phalanx.comm",
    "is_initialized": "phalanx.comm",
    "is_main": "phalanx.comm",
    "isend": "phalanx.comm",
    "main_first": "phalanx.comm",
    "process_group": "phalanx.comm",
    "recv": "phalanx.comm",
    "reduce": "phalanx.comm",
    "reduce_scatter": "phalanx.comm",
    "reduce_scatter_tensor": "phalanx.comm",
    "reset_comm_stats": "phalanx.comm",
    "scatter": "phalanx.comm",
    "scatter_object_list": "phalanx.comm",
    "send": "phalanx.comm",
    "world": "phalanx.comm",
    "ActivationCheckpointing": "phalanx.activation_checkpointing",
    "checkpoint_activations": "phalanx.activation_checkpointing",
    "DistributedSampler": "phalanx.data",
    "DataParallel": "phalanx.data_parallel",
    "DistributedDataParallel": "phalanx.data_parallel",
    "SyncBatchNorm": "phalanx.data_parallel",
    "SpawnError": "phalanx.launch",
    "spawn": "phalanx.launch",
    "split_across_devices": "phalanx.model_parallel",
    "memory_report": "phalanx.plan",
    "ZeroRedundancyOptimizer": "phalanx.sharding",
    "FullyShardedDataParallel": "phalanx.sharding.zero3",
    "Job": "phalanx.train",
    "DDP": "phalanx.train",
    "Zero": "phalanx.train",
    "Mesh": "phalanx.train",
    "PS": "phalanx.train",
    "Hogwild": "phalanx.train",
    "LocalSGD": "phalanx.train",
    "DiLoCo": "phalanx.train",
    "StreamingDiLoCo": "phalanx.train",
    "TorchDDP": "phalanx.train",
    "TorchZero1": "phalanx.train",
    "TorchFSDP": "phalanx.train",
}
"""Exported names -> the module that defines them, imported on first use: ``import phalanx``
costs no torch (``phalanx run``'s agent runs without it)."""


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY_NAMES, _SUBMODULES)


__all__ = [
    "DDP",
    "PS",
    "ActivationCheckpointing",
    "CollectiveError",
    "DataParallel",
    "DiLoCo",
    "DistributedDataParallel",
    "DistributedSampler",
    "FullyShardedDataParallel",
    "Hogwild",
    "Job",
    "LocalSGD",
    "Mesh",
    "ReduceOp",
    "SpawnError",
    "StreamingDiLoCo",
    "SyncBatchNorm",
    "TorchDDP",
    "TorchFSDP",
    "TorchZero1",
    "World",
    "Zero",
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
    "checkpoint_activations",
    "comm_stats",
    "destroy_process_group",
    "gather",
    "gather_object",
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
