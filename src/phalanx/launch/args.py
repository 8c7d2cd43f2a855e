"""Flags of ``phalanx run``: every option of torchrun's parser, with torchrun's meaning.

Parsing is a pure function of ``argv``, the environment (torchrun reads each option's default
from ``PET_<OPTION>`` too) and a device probe (for ``--nproc-per-node auto|cpu|gpu``).
:func:`parse_args` returns a frozen :class:`LaunchConfig` or raises :class:`ArgsError` naming
the flag, the value and the fix; nothing is started before that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping

from phalanx.comm.backends import shm_unusable
from phalanx.launch import checks
from phalanx.launch.config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_RDZV_TIMEOUT_S,
    DEFAULT_SHUTDOWN_S,
    RECOVERY_MODES,
    ArgsError,
    LaunchConfig,
    LogOptions,
)
from phalanx.launch.nproc import DeviceProbe, check_nproc, local_world_size, probe_devices
from phalanx.launch.options import BACKENDS, build_parser

__all__ = ["BACKENDS", "ArgsError", "LaunchConfig", "notes", "parse_args"]

RDZV_BACKENDS = ("static", "c10d")
C10D_DEFAULT_PORT = 29400
"""torchrun's default port of a c10d ``--rdzv-endpoint`` given without one."""
START_METHODS = ("spawn", "fork", "forkserver")
EVENT_HANDLERS = ("null", "console", "dynamic_rendezvous")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def _one_of(flag: str, value: str | None, allowed: tuple[str, ...], why: str = "") -> None:
    if value is not None and value not in allowed:
        raise ArgsError(f"{flag} {value!r} is not one of {', '.join(allowed)}{why}")


def _check_choices(ns: argparse.Namespace) -> None:
    _one_of("--backend", ns.backend, BACKENDS)
    if ns.backend == "shm" and (cannot := shm_unusable()) is not None:
        raise ArgsError(
            f"--backend shm: the shared-memory backend cannot run on {cannot}; pass --backend gloo"
        )
    _one_of(
        "--rdzv-backend",
        ns.rdzv_backend,
        RDZV_BACKENDS,
        ": phalanx runs its own rendezvous over a TCP store hosted by node 0, as torchrun's "
        "static and c10d backends do; pass --rdzv-backend c10d (or leave it out) with "
        "--rdzv-endpoint HOST:PORT of node 0",
    )
    _one_of("--start-method", ns.start_method, START_METHODS)
    _one_of(
        "--event-log-handler",
        ns.event_log_handler,
        EVENT_HANDLERS,
        " (torchrun's registered handlers)",
    )
    _one_of("--numa-binding", ns.numa_binding, NUMA_MODES)
    _one_of("--recovery", ns.recovery, RECOVERY_MODES)
    if ns.recovery == "live" and _min_nodes(ns.nnodes):
        raise ArgsError(
            f"--recovery live with --nnodes {ns.nnodes}: live recovery replaces workers, not "
            f"nodes, and a lost node ends a live job; pass a fixed --nnodes or --recovery restart"
        )
    if ns.module and ns.no_python:
        raise ArgsError("-m/--module and --no-python cannot be combined; pass only one")
    if ns.module and ns.run_path:
        raise ArgsError("-m/--module and --run-path cannot be combined; pass only one")
    if not ns.role:
        raise ArgsError("--role '' is empty; pass a name such as trainer (default: default)")


def _master(ns: argparse.Namespace, nnodes: int) -> tuple[str, int]:
    """Node 0's store: --rdzv-endpoint, else --master-addr and --master-port. As torchrun, a
    single node given no port takes a free one (two jobs on one machine do not collide)."""
    if ns.rdzv_endpoint:
        default = C10D_DEFAULT_PORT if ns.rdzv_backend == "c10d" else DEFAULT_MASTER_PORT
        return checks.endpoint(ns.rdzv_endpoint, default)
    if ns.master_port is None:
        return ns.master_addr, 0 if nnodes == 1 else DEFAULT_MASTER_PORT
    return ns.master_addr, checks.port("--master-port", ns.master_port)


def _topology(ns: argparse.Namespace) -> tuple[int, int | None, str, int]:
    """Return nnodes (the maximum), node rank (None: taken at the rendezvous, torchrun's c10d
    form without --node-rank), master address and port, applying --standalone."""
    nnodes = checks.nnodes(ns.nnodes)[1]
    node_rank = None if ns.node_rank is None else checks.integer("--node-rank", ns.node_rank, 0)
    if ns.standalone:
        if nnodes != 1 or node_rank not in (None, 0):
            raise ArgsError(
                f"--standalone runs a single node, but --nnodes {ns.nnodes} --node-rank "
                f"{ns.node_rank} was given; drop --standalone or those flags"
            )
        return 1, 0, DEFAULT_MASTER_ADDR, 0
    if node_rank is not None and node_rank >= nnodes:
        raise ArgsError(
            f"--node-rank {node_rank} is invalid with --nnodes {nnodes}: node ranks are "
            f"0..{nnodes - 1}"
        )
    if node_rank is None and (nnodes == 1 or ns.rdzv_backend != "c10d"):
        node_rank = 0
    addr, port = _master(ns, nnodes)
    return nnodes, node_rank, addr, port


def _min_nodes(raw: str) -> int:
    """MIN of an elastic ``--nnodes MIN:MAX``; 0 for a fixed number of nodes."""
    lo, hi = checks.nnodes(raw)
    return lo if lo < hi else 0


def _rdzv_timeout(ns: argparse.Namespace, node_rank: int | None) -> float:
    """``--rdzv-timeout``, or torchrun's ``--rdzv-conf timeout=`` / ``join_timeout=``."""
    given = {f"--rdzv-conf {k}=": v for k, v in checks.rdzv_conf(ns.rdzv_conf, node_rank).items()}
    if ns.rdzv_timeout is not None:
        given["--rdzv-timeout "] = ns.rdzv_timeout
    values = {flag + raw: checks.seconds(flag.strip(" ="), raw) for flag, raw in given.items()}
    if len(set(values.values())) > 1:
        raise ArgsError(f"the rendezvous timeout is given twice, differently: {', '.join(values)}")
    return next(iter(values.values()), DEFAULT_RDZV_TIMEOUT_S)


def _shutdown_timeout(ns: argparse.Namespace, environ: Mapping[str, str]) -> float:
    if ns.shutdown_timeout is not None:
        return checks.seconds("--shutdown-timeout", ns.shutdown_timeout, allow_zero=True)
    env = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if env:
        return checks.seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env, allow_zero=True)
    return DEFAULT_SHUTDOWN_S


def _check_gpus(
    ns: argparse.Namespace, nproc: int, environ: Mapping[str, str], probe: DeviceProbe
) -> None:
    """--numa-binding and --virtual-local-rank map local rank i to GPU i: check there is one."""
    if ns.numa_binding is not None and ns.bind_cores:
        raise ArgsError(
            f"--bind-cores and --numa-binding {ns.numa_binding} both bind the workers: pick one "
            f"(--numa-binding for GPU workers, --bind-cores for CPU workers)"
        )
    if ns.numa_binding is not None:
        gpus = probe("gpu")
        if not gpus or gpus < nproc:
            raise ArgsError(
                f"--numa-binding {ns.numa_binding} binds local rank i to the CPUs near GPU i, "
                f"but this machine has {gpus or 0} CUDA device(s) for {nproc} workers; drop "
                f"--numa-binding (--bind-cores pins CPU workers to cores of their own)"
            )
        if shutil.which("numactl") is None:
            raise ArgsError(f"--numa-binding {ns.numa_binding} needs the numactl command")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if ns.virtual_local_rank and visible is not None and len(visible.split(",")) < nproc:
        raise ArgsError(
            f"--virtual-local-rank gives local rank i the i-th of CUDA_VISIBLE_DEVICES="
            f"{visible}, which lists fewer than the {nproc} workers"
        )


def _logs(ns: argparse.Namespace, nproc: int, environ: Mapping[str, str]) -> LogOptions:
    if ns.log_dir and os.path.isfile(ns.log_dir):
        raise ArgsError(f"--log-dir {ns.log_dir} is a file; pass a directory")
    return LogOptions(
        log_dir=ns.log_dir or None,
        redirects=checks.std_spec("--redirects", ns.redirects, nproc),
        tee=checks.std_spec("--tee", ns.tee, nproc),
        local_ranks_filter=checks.rank_set("--local-ranks-filter", ns.local_ranks_filter, nproc),
        duplicate_stdout_filters=checks.comma_list(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=checks.comma_list(ns.duplicate_stderr_filters),
        logs_specs=ns.logs_specs,
        prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
    )


def parse_args(
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    probe: DeviceProbe | None = None,
) -> LaunchConfig:
    """Parse and validate the flags of ``phalanx run`` (everything after ``run``).

    Args:
        argv: the arguments after ``run``.
        environ: where ``PET_*`` defaults and torchrun's variables are read (os.environ).
        probe: device counts for ``--nproc-per-node auto|cpu|gpu`` (default: ask torch).

    Raises:
        ArgsError: a flag is unknown, malformed or out of range, or the script is missing.
    """
    environ = os.environ if environ is None else environ
    ns = build_parser(environ).parse_args(argv)
    _check_choices(ns)
    nnodes, node_rank, addr, port = _topology(ns)
    probe = probe or probe_devices
    nproc = check_nproc(local_world_size(ns.nproc_per_node, probe), ns.nproc_per_node, environ)
    _check_gpus(ns, nproc, environ, probe)
    return LaunchConfig(
        nproc_per_node=nproc,
        nnodes=nnodes,
        min_nodes=_min_nodes(ns.nnodes),
        node_rank=node_rank or 0,
        node_rank_auto=node_rank is None,
        master_addr=addr,
        master_port=port,
        standalone=ns.standalone,
        rdzv_backend=ns.rdzv_backend,
        rdzv_id=None if ns.rdzv_id in ("", "none") else ns.rdzv_id,
        rdzv_timeout=_rdzv_timeout(ns, node_rank),
        max_restarts=checks.integer("--max-restarts", ns.max_restarts, minimum=0),
        recovery=ns.recovery,
        monitor_interval=checks.seconds("--monitor-interval", ns.monitor_interval),
        shutdown_timeout=_shutdown_timeout(ns, environ),
        signals_to_handle=checks.signals(ns.signals_to_handle),
        signals_text=ns.signals_to_handle,
        backend=ns.backend,
        timeline_dir=_timeline(ns.timeline),
        role=ns.role,
        local_addr=ns.local_addr or None,
        numa_binding=ns.numa_binding,
        virtual_local_rank=ns.virtual_local_rank,
        bind_cores=ns.bind_cores,
        start_method=ns.start_method,
        event_log_handler=ns.event_log_handler,
        logs=_logs(ns, nproc, environ),
        python=environ.get("PYTHON_EXEC") or sys.executable,
        module=ns.module,
        no_python=ns.no_python and not ns.run_path,
        run_path=ns.run_path,
        script=ns.script,
        script_args=tuple(ns.script_args),
    )


def _timeline(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.strip():
        raise ArgsError("--timeline '' is empty; pass the folder the ranks record into")
    return os.path.abspath(value)  # the workers may run in another directory


def notes(cfg: LaunchConfig) -> list[str]:
    """Warnings about flags that are accepted but change nothing here (said once, at start)."""
    found = []
    if cfg.run_path and cfg.start_method != "spawn":
        found.append(
            f"--start-method {cfg.start_method}: phalanx starts each --run-path worker as a "
            f"fresh interpreter (as spawn does), not by {cfg.start_method}"
        )
    return found
