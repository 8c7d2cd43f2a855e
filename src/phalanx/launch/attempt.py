"""What one attempt starts on this node: each worker's command, environment, prefix and logs.

This is where the flags meet the rendezvous: the agreed ranks and worker store give each
worker its environment (:func:`~phalanx.launch.worker_env.worker_env`, plus
``PHALANX_MIN_LOCAL_WORLD_SIZE``: the fewest ranks any node runs, for the "auto" backend), the
log plan adds its TORCHELASTIC_ERROR_FILE and files, and global rank 0 gets the launcher's stdin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.comm.backends import MIN_LOCAL_ENV
from phalanx.comm.netif import gloo_interface as pinned_interface
from phalanx.launch.config import LaunchConfig
from phalanx.launch.cores import BIND_ENV, available_cores, core_blocks
from phalanx.launch.logs import AttemptLogs, RunLogs
from phalanx.launch.nproc import probe_devices
from phalanx.launch.output import console_env
from phalanx.launch.prefix import line_prefix
from phalanx.launch.rendezvous import Rendezvous
from phalanx.launch.worker_env import JobContext, Placement, worker_env
from phalanx.launch.workers import WorkerSpec, numa_bound, worker_command

__all__ = ["gloo_interface", "worker_specs"]


def gloo_interface(cfg: LaunchConfig, base: Mapping[str, str] = os.environ) -> str | None:
    """The interface gloo should use: the one owning --local-addr, else the route to the
    master; None where ``base`` has the user's GLOO_SOCKET_IFNAME (``comm/netif.py``)."""
    return pinned_interface(base, cfg.master_addr, cfg.local_addr)


def _job(
    cfg: LaunchConfig, rdzv: Rendezvous, secret: str | None, base: Mapping[str, str]
) -> JobContext:
    return JobContext(
        master_addr=cfg.master_addr,
        master_port=rdzv.worker_port,
        restart_count=rdzv.generation,
        max_restarts=rdzv.max_restarts,
        run_id=rdzv.run_id,
        backend=cfg.backend,
        gloo_ifname=gloo_interface(cfg, base),
        secret=secret,
        role=cfg.role,
        signals=cfg.signals_text,
        virtual_local_rank=cfg.virtual_local_rank,
        recovery=cfg.recovery,
        timeline_dir=cfg.timeline_dir,
        cpu=probe_devices("accelerator") is None,
    )


def _command(cfg: LaunchConfig, local_rank: int) -> list[str]:
    command = worker_command(
        cfg.script, cfg.script_args, cfg.module, cfg.no_python, cfg.run_path, cfg.python
    )
    if cfg.numa_binding is None:
        return command
    return numa_bound(command, local_rank, cfg.numa_binding)


def worker_specs(
    cfg: LaunchConfig,
    rdzv: Rendezvous,
    secret: str | None,
    logs: RunLogs,
    base: Mapping[str, str] = os.environ,
) -> tuple[list[WorkerSpec], AttemptLogs]:
    """The workers of this node for the attempt ``rdzv`` agreed on, and where their logs go."""
    job = _job(cfg, rdzv, secret, base)
    places = [
        Placement(
            rank=rdzv.rank_offset + local,
            local_rank=local,
            world_size=rdzv.world_size,
            local_world_size=cfg.nproc_per_node,
            node_rank=cfg.node_rank,
            nnodes=rdzv.nnodes,
        )
        for local in range(cfg.nproc_per_node)
    ]
    # The rendezvous knows every node's rank count; the "auto" backend across machines needs
    # the fewest (comm.backends.auto_backend), which no single node's variables tell.
    fewest = {MIN_LOCAL_ENV: str(rdzv.fewest_local)}
    envs = [{**worker_env(base, place, job), **fewest} for place in places]
    if cfg.bind_cores:
        for env, block in zip(envs, core_blocks(available_cores(), cfg.nproc_per_node)):
            env[BIND_ENV] = ",".join(map(str, block))
            if "OMP_NUM_THREADS" not in base:
                env["OMP_NUM_THREADS"] = str(len(block))
    plan = logs.attempt(rdzv.run_id, rdzv.generation, envs)
    template = cfg.logs.prefix_template
    prefixes = [line_prefix(template, cfg.role, p.rank, p.local_rank) for p in places]
    specs = [
        WorkerSpec(
            rank=place.rank,
            local_rank=place.local_rank,
            command=_command(cfg, place.local_rank),
            env={**env, **(console_env(base, prefix) if where.stderr.console else {})},
            stdin=place.rank == 0,
            prefix=prefix,
            logs=where,
        )
        for place, env, prefix, where in zip(places, envs, prefixes, plan.workers)
    ]
    return specs, plan
