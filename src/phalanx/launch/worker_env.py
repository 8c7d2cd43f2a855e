"""The environment contract between the launcher and each worker, as one pure function.

Workers read it with :mod:`phalanx.comm.env` or with torch's own ``env://`` initialisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from phalanx.comm.auth import SECRET_ENV

__all__ = ["JobContext", "Placement", "default_omp_threads", "worker_env"]


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


def default_omp_threads(cpu_count: int, local_world_size: int) -> int:
    """Share the node's cores between its workers, as torchrun does: at least one thread each."""
    return max(1, cpu_count // max(1, local_world_size))


def worker_env(
    base: Mapping[str, str], place: Placement, job: JobContext, cpu_count: int
) -> dict[str, str]:
    """Environment of one worker: ``base`` plus the rank/world/master variables.

    Variables the user already set in ``base`` win for OMP_NUM_THREADS and GLOO_SOCKET_IFNAME;
    the rank, world and store variables are always the launcher's.
    """
    env = dict(base)
    env.update(
        RANK=str(place.rank),
        LOCAL_RANK=str(place.local_rank),
        WORLD_SIZE=str(place.world_size),
        LOCAL_WORLD_SIZE=str(place.local_world_size),
        GROUP_RANK=str(place.node_rank),
        GROUP_WORLD_SIZE=str(place.nnodes),
        ROLE_RANK=str(place.rank),
        ROLE_WORLD_SIZE=str(place.world_size),
        ROLE_NAME="default",
        MASTER_ADDR=job.master_addr,
        MASTER_PORT=str(job.master_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(job.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(job.max_restarts),
        TORCHELASTIC_RUN_ID=job.run_id,
        PHALANX_RUN_ID=job.run_id,
        PHALANX_RESTART_COUNT=str(job.restart_count),
        PYTHONUNBUFFERED="1",
    )
    if job.backend is not None:
        env["PHALANX_BACKEND"] = job.backend
    if job.secret is not None:
        env[SECRET_ENV] = job.secret
    if "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(default_omp_threads(cpu_count, place.local_world_size))
    if job.gloo_ifname and "GLOO_SOCKET_IFNAME" not in base:
        env["GLOO_SOCKET_IFNAME"] = job.gloo_ifname
    return env
