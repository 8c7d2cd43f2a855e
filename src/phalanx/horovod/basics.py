"""Horovod's process functions: ``init``, ``rank``, ``size``, ``local_rank`` ... over phalanx.

``init()`` joins phalanx's default process group (reading the ``phalanx run`` / torchrun / SLURM /
Open MPI environment), so a Horovod script runs under ``phalanx run`` unchanged, and sets up the
global process set. ``shutdown()`` then ``init()`` works as often as needed: every generation's
rendezvous keys are namespaced (``comm/group.py``), so none of the previous group's is read.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from phalanx.comm import group as pg
from phalanx.comm.env import discover_env
from phalanx.comm.errors import CollectiveError
from phalanx.horovod import process_sets as psets

__all__ = [
    "HorovodInternalError",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]

HorovodInternalError = CollectiveError
"""Raised when a collective fails (a peer died, a timeout, ranks disagree): a RuntimeError."""

_OWNS_GROUP = False


def _timeout() -> float | None:
    raw = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(
            f"HOROVOD_GLOO_TIMEOUT_SECONDS={raw!r} must be a positive number of seconds"
        )
    return seconds


def init(comm: object = None, process_sets: object = None) -> None:
    """Join the job (``phalanx.init_process_group()`` from the environment); idempotent.

    Under ``phalanx run`` / torchrun the environment names rank, world size and rendezvous; a
    plain ``python script.py`` runs as a single process of world size 1. The collective timeout
    is ``HOROVOD_GLOO_TIMEOUT_SECONDS`` when set (phalanx's 300 s otherwise).

    Args:
        comm: Horovod's MPI communicator or list of ranks; only None is supported.
        process_sets: Horovod's static process sets; only None is supported (use
            :func:`~phalanx.horovod.add_process_set` after ``init()``).
    """
    global _OWNS_GROUP
    if comm is not None or process_sets is not None:
        raise ValueError(
            "init(comm=..., process_sets=...) is not supported: call hvd.init() "
            "on every rank, then hvd.add_process_set(ranks)"
        )
    if not dist.is_initialized():
        pg.init_process_group(timeout=_timeout())
        _OWNS_GROUP = True
    psets.setup()


def shutdown() -> None:
    """Forget process sets and operations in flight; leave the job if :func:`init` joined it
    (a group made by the caller is left alone)."""
    global _OWNS_GROUP
    psets.reset()
    if _OWNS_GROUP:
        pg.destroy_process_group()
        _OWNS_GROUP = False


def is_initialized() -> bool:
    """True once :func:`init` (or ``phalanx.init_process_group``) has run."""
    return dist.is_initialized()


def _require_init() -> None:
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() first")


def rank() -> int:
    """This process's global rank."""
    _require_init()
    return dist.get_rank()


def size() -> int:
    """The number of processes in the job."""
    _require_init()
    return dist.get_world_size()


def local_rank() -> int:
    """This process's rank on its machine (selects the GPU)."""
    _require_init()
    return pg.world().local_rank if pg.is_initialized() else discover_env().local_rank


def local_size() -> int:
    """The number of processes on this machine."""
    _require_init()
    return pg.world().local_world_size if pg.is_initialized() else discover_env().local_world_size


def cross_rank() -> int:
    """The index of this machine (rank among the processes with the same local rank)."""
    _require_init()
    return pg.world().node_rank if pg.is_initialized() else discover_env().node_rank


def cross_size() -> int:
    """The number of machines (assuming the same number of processes on each)."""
    return max(1, size() // local_size())


def mpi_threads_supported() -> bool:
    """False: phalanx does not run collectives on MPI threads."""
    return False


def mpi_built() -> bool:
    """True if torch was built with the MPI backend."""
    return dist.is_mpi_available()


def mpi_enabled() -> bool:
    """True if the job runs on the MPI backend."""
    return dist.is_initialized() and dist.get_backend() == "mpi"


def gloo_built() -> bool:
    """True if torch was built with the gloo backend."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """True if the job runs on the gloo backend."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def nccl_built() -> bool:
    """True if torch was built with NCCL."""
    return dist.is_nccl_available()


def cuda_built() -> bool:
    """True if torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True if torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False
