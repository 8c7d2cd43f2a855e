"""Discover rank, world size and master address from the launcher's environment.

Pure functions over an environment mapping, so every launcher's conventions are unit-tested
without processes. Supported, in this order of precedence:

* phalanx run / torchrun / Kubeflow PyTorchJob: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, the first host
  of ``SLURM_NODELIST`` as master;
* Open MPI: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "discover_env", "first_slurm_host"]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process's place in the job."""

    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of processes in the job."""
    local_rank: int = 0
    """Rank of this process on its node."""
    local_world_size: int = 1
    """Number of processes on this node."""
    node_rank: int = 0
    """Index of this node."""
    master_addr: str | None = None
    """Host of the rendezvous store, if the environment names one."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of the rendezvous store."""
    restart_count: int = 0
    """How many times the launcher restarted the workers."""
    agent_store: bool = False
    """True when the launcher hosts the store (every rank connects as a client)."""
    source: str = "none"
    """Which convention was found: phalanx, torchrun, kubeflow, slurm, openmpi or none."""


def _int(
    env: Mapping[str, str], name: str, default: int | None = None, low: int = 0, high: int = -1
) -> int:
    """The integer environment variable ``name``, in ``low..high`` (no upper bound for -1)."""
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < low or (high >= 0 and value > high):
        bounds = f"{low}..{high}" if high >= 0 else f">= {low}"
        raise ValueError(f"environment variable {name}={raw!r} must be {bounds}")
    return value


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _common(env: Mapping[str, str]) -> dict[str, object]:
    return {
        "master_addr": env.get("MASTER_ADDR") or None,
        "master_port": _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535),
        "restart_count": _int(
            env, "PHALANX_RESTART_COUNT", _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        ),
        "agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    }


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE", low=1)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1 if "LOCAL_RANK" not in env else world, 1)
    if "PHALANX_RUN_ID" in env:
        source = "phalanx"
    elif "TORCHELASTIC_RUN_ID" in env:
        source = "torchrun"
    elif "PET_NNODES" in env or "KUBERNETES_SERVICE_HOST" in env:
        source = "kubeflow"
    else:
        source = "env"
    default_node = rank // local_world if local_world > 0 else 0
    return LaunchEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", default_node),
        source=source,
        **_common(env),  # type: ignore[arg-type]
    )


def _slurm_local_world(env: Mapping[str, str], world: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),2"; this node's count is SLURM_NTASKS_PER_NODE
    # when set, else the first group's count (exact for the usual homogeneous allocation).
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    tasks = env.get("SLURM_TASKS_PER_NODE")
    if tasks:
        return int(re.match(r"\d+", tasks).group(0))  # type: ignore[union-attr]
    return world


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_NTASKS", low=1)
    common = _common(env)
    if common["master_addr"] is None and env.get("SLURM_NODELIST"):
        common["master_addr"] = first_slurm_host(env["SLURM_NODELIST"])
    if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
        # Same job -> same port on every node; different jobs rarely collide.
        common["master_port"] = 20000 + _int(env, "SLURM_JOB_ID") % 20000
    return LaunchEnv(
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=_slurm_local_world(env, world),
        node_rank=_int(env, "SLURM_NODEID", 0),
        source="slurm",
        **common,  # type: ignore[arg-type]
    )


def _from_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    return LaunchEnv(
        rank=rank,
        world_size=_int(env, "OMPI_COMM_WORLD_SIZE", low=1),
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=rank // max(local_world, 1),
        source="openmpi",
        **_common(env),  # type: ignore[arg-type]
    )


def discover_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read this process's place in the job from ``env`` (default: ``os.environ``).

    Returns a world of one process when no launcher convention is present.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _from_openmpi(env)
    return LaunchEnv(**_common(env))  # type: ignore[arg-type]
