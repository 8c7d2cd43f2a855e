"""The environment contract between the launcher and each worker, as one pure function.

Workers read it with :mod:`phalanx.comm.env` or with torch's own ``env://`` initialisation. It
holds every variable torchrun's agent sets (``LocalElasticAgent._start_workers`` and the
launcher's own ``OMP_NUM_THREADS`` / ``TORCHELASTIC_SIGNALS_TO_HANDLE``), compared variable by
variable with a real torchrun in the tests; the log planner adds ``TORCHELASTIC_ERROR_FILE``.
Under ``--recovery live`` each worker also gets its slot's variables (:mod:`.live_keys`); they
are never inherited from the launcher's own environment. PYTHONPATH starts with the folder of the
workers' start-up hook (:mod:`.worker_site`), which installs the exit guard and then puts the
user's PYTHONPATH back before the script runs; on CPU workers the hook also makes Accelerate see
the job's ranks (:func:`~phalanx.launch.worker_site.accelerate_env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from phalanx.comm.auth import SECRET_ENV
from phalanx.launch.config import DEFAULT_SIGNALS
from phalanx.launch.live_keys import LIVE_ENV, live_env
from phalanx.launch.worker_site import accelerate_env, site_env

__all__ = ["JobContext", "Placement", "worker_env"]


@dataclass(frozen=True)
class Placement:
    """Where one worker sits in the job of one generation."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    world_size: int
    """Workers in the whole job."""
    local_world_size: int
    """Workers on this node."""
    node_rank: int
    """Index of this node."""
    nnodes: int
    """Number of nodes."""


@dataclass(frozen=True)
class JobContext:
    """What every worker of one generation on one node shares."""

    master_addr: str
    """Host of the generation's worker store."""
    master_port: int
    """Port of the generation's worker store (fresh for each generation)."""
    restart_count: int
    """Generation number: 0 on the first attempt."""
    max_restarts: int
    """The --max-restarts of the job."""
    run_id: str
    """Run id shared by all nodes."""
    backend: str | None = None
    """--backend, passed as PHALANX_BACKEND when given."""
    gloo_ifname: str | None = None
    """Interface routing to the master, for GLOO_SOCKET_IFNAME when the user did not set it."""
    secret: str | None = field(default=None, repr=False)
    """The job's secret for PHALANX_JOB_SECRET (kept out of repr: never logged)."""
    role: str = "default"
    """ROLE_NAME (``--role``)."""
    signals: str = DEFAULT_SIGNALS
    """TORCHELASTIC_SIGNALS_TO_HANDLE (``--signals-to-handle`` as given)."""
    virtual_local_rank: bool = False
    """``--virtual-local-rank``: LOCAL_RANK=0 and only the worker's own GPU visible."""
    recovery: str = "restart"
    """``--recovery``: ``live`` adds PHALANX_RECOVERY, PHALANX_MEMBER_ID, PHALANX_INCARNATION=0."""
    timeline_dir: str | None = None
    """``--timeline``, passed as PHALANX_TIMELINE_DIR when given."""
    cpu: bool = False
    """The workers compute on the CPU (this node has no accelerator): Accelerate needs
    ACCELERATE_USE_CPU=1 there (:func:`~phalanx.launch.worker_site.accelerate_env`)."""


def _local_rank_env(base: Mapping[str, str], local_rank: int, virtual: bool) -> dict[str, str]:
    """LOCAL_RANK, and with ``--virtual-local-rank`` the one GPU this worker sees (as torchrun)."""
    if not virtual:
        return {"LOCAL_RANK": str(local_rank)}
    visible = base.get("CUDA_VISIBLE_DEVICES")
    gpu = visible.split(",")[local_rank].strip() if visible is not None else str(local_rank)
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": gpu}


def worker_env(base: Mapping[str, str], place: Placement, job: JobContext) -> dict[str, str]:
    """Environment of one worker: ``base`` plus the rank/world/master variables.

    Variables the user already set in ``base`` win for OMP_NUM_THREADS, GLOO_SOCKET_IFNAME and
    TORCH_NCCL_ASYNC_ERROR_HANDLING; the rank, world and store variables are the launcher's.
    As in torchrun, OMP_NUM_THREADS is 1 when several workers share the node and the user did
    not set it (one OpenMP thread per core per worker would oversubscribe the cores).
    """
    # A launcher started by a live worker must not pass the live contract on in restart mode.
    env = {k: v for k, v in base.items() if k not in LIVE_ENV}
    env.update(
        RANK=str(place.rank),
        WORLD_SIZE=str(place.world_size),
        LOCAL_WORLD_SIZE=str(place.local_world_size),
        GROUP_RANK=str(place.node_rank),
        GROUP_WORLD_SIZE=str(place.nnodes),
        ROLE_RANK=str(place.rank),
        ROLE_WORLD_SIZE=str(place.world_size),
        ROLE_NAME=job.role,
        MASTER_ADDR=job.master_addr,
        MASTER_PORT=str(job.master_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(job.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
        TORCHELASTIC_RUN_ID=job.run_id,
        TORCHELASTIC_SIGNALS_TO_HANDLE=job.signals,
        TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        PHALANX_RUN_ID=job.run_id,
        PHALANX_RESTART_COUNT=str(job.restart_count),
        PYTHONUNBUFFERED="1",
    )
    env.update(_local_rank_env(base, place.local_rank, job.virtual_local_rank))
    env.update(site_env(base))
    env.update(accelerate_env(base, job.cpu, place.world_size))
    if job.recovery == "live":
        env.update(live_env(place.node_rank, place.local_rank))
    if job.backend is not None:
        env["PHALANX_BACKEND"] = job.backend
    if job.timeline_dir is not None:
        env["PHALANX_TIMELINE_DIR"] = job.timeline_dir
    if job.secret is not None:
        env[SECRET_ENV] = job.secret
    if "OMP_NUM_THREADS" not in base and place.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    if job.gloo_ifname and "GLOO_SOCKET_IFNAME" not in base:
        env["GLOO_SOCKET_IFNAME"] = job.gloo_ifname
    return env
