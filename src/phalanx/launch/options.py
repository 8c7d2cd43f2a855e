"""The option table of ``phalanx run``: torchrun's options (both spellings) and phalanx's own.

Each option's default may come from ``PET_<OPTION>``, as torchrun's ``env`` actions do. Values
stay strings here; :mod:`phalanx.launch.args` checks them and builds the configuration.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import NoReturn

from phalanx.comm.backends import BACKENDS
from phalanx.launch.config import DEFAULT_MASTER_ADDR, DEFAULT_SIGNALS, ArgsError

__all__ = ["BACKENDS", "build_parser"]

METAVARS = {
    "nnodes": "N|MIN:MAX",
    "nproc_per_node": "N|cpu|gpu|auto",
    "max_restarts": "N",
    "recovery": "restart|live",
    "monitor_interval": "SECONDS",
    "start_method": "METHOD",
    "signals_to_handle": "SIGNALS",
    "shutdown_timeout": "SECONDS",
    "numa_binding": "MODE",
    "rdzv_endpoint": "HOST:PORT",
    "rdzv_id": "ID",
    "rdzv_conf": "KEY=VALUE,...",
    "rdzv_timeout": "SECONDS",
    "node_rank": "N",
    "master_addr": "HOST",
    "master_port": "PORT",
    "local_addr": "HOST",
    "backend": "|".join(BACKENDS),
    "log_dir": "DIR",
    "timeline": "DIR",
    "redirects": "0-3|R:V,...",
    "tee": "0-3|R:V,...",
    "local_ranks_filter": "R,...",
    "duplicate_stdout_filters": "TEXT,...",
    "duplicate_stderr_filters": "TEXT,...",
}
"""How each value is written in the usage text (default NAME)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so parsing stays a pure function."""

    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = (
                "missing the script to run: phalanx run [flags] SCRIPT [ARGS...] "
                "(or -m MODULE, or --no-python EXECUTABLE)"
            )
        raise ArgsError(message)


def _dest(flags: tuple[str, ...]) -> str:
    long = next(f for f in flags if f.startswith("--"))
    return long[2:].replace("-", "_")


class _Options:
    """Adds options whose default, as in torchrun, may come from ``PET_<DEST>``."""

    def __init__(self, group: argparse._ArgumentGroup, environ: Mapping[str, str]) -> None:
        self.group = group
        self.environ = environ

    def value(self, *flags: str, default: str | None, help: str, pet: bool = True) -> None:
        dest = _dest(flags)
        env = self.environ.get(f"PET_{dest.upper()}") if pet else None
        self.group.add_argument(
            *flags,
            default=env if env is not None else default,
            help=help,
            metavar=METAVARS.get(dest, "NAME"),
        )

    def flag(self, *flags: str, help: str) -> None:
        name = f"PET_{_dest(flags).upper()}"
        raw = self.environ.get(name, "0")
        if raw not in ("0", "1"):
            raise ArgsError(
                f"{name}={raw!r} (the environment's default of {flags[-1]}): use 0 or 1"
            )
        self.group.add_argument(*flags, action="store_true", default=raw == "1", help=help)


def build_parser(environ: Mapping[str, str]) -> _Parser:
    p = _Parser(
        prog="phalanx run",
        description="Start N worker processes per node. Accepts every torchrun option, with "
        "torchrun's meaning; PET_<OPTION> environment variables give defaults, as in torchrun.",
        allow_abbrev=False,
    )
    w = _Options(p.add_argument_group("workers"), environ)
    w.value("--nnodes", default="1", help="number of nodes, or MIN:MAX (elastic)")
    w.value(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help="workers per node: N, cpu (usable CPUs), gpu, xpu, or auto (accelerators, "
        "else CPUs), as torchrun decides",
    )
    w.value("--role", default="default", help="ROLE_NAME of the workers")
    w.value(
        "--max-restarts",
        "--max_restarts",
        default="0",
        help="--recovery restart: how many times every worker is restarted after a failure. "
        "--recovery live: how many dead workers are replaced, counted over the whole job (all "
        "slots, all nodes); once none is left, the survivors go on without the dead",
    )
    w.value(
        "--recovery",
        default="restart",
        pet=False,
        help="restart (default): a failed worker stops every worker; with --max-restarts left "
        "all restart and meet again (a script resumes from its checkpoint). live: only the dead "
        "worker is replaced (PHALANX_MEMBER_ID, PHALANX_INCARNATION) and the others keep "
        "running; the worker store lives for the whole job. live needs workers that regroup "
        "in-process, so restart stays the default until phalanx.Job does so. The exit code is "
        "0 when some workers run to the end with exit 0 and none dies after the first of them "
        "finished; a worker lost before that is named in the summary. A lost node ends the job",
    )
    w.value(
        "--monitor-interval",
        "--monitor_interval",
        default="0.1",
        help="seconds between health checks of the workers",
    )
    w.value(
        "--start-method",
        "--start_method",
        default="spawn",
        help="spawn|fork|forkserver. As under torchrun for a script, every worker is a "
        "fresh process; phalanx does so with --run-path too (fork/forkserver: a warning)",
    )
    w.value(
        "--signals-to-handle",
        "--signals_to_handle",
        default=DEFAULT_SIGNALS,
        help="signals the launcher forwards to the workers before stopping them",
    )
    w.value(
        "--shutdown-timeout",
        "--shutdown_timeout",
        default=None,
        help="seconds between the stop signal and SIGKILL (default: "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 3)",
    )
    w.value(
        "--numa-binding",
        "--numa_binding",
        default=None,
        pet=False,
        help="node|socket|exclusive|core-complex: bind each worker to the CPUs near its GPU "
        "(torch's binding via numactl; needs CUDA; CPU workers: --bind-cores)",
    )
    w.flag(
        "--bind-cores",
        "--bind_cores",
        help="phalanx: pin each worker to cores of its own (the node's cores split evenly over "
        "its workers), OMP_NUM_THREADS to match; the CPU counterpart of --numa-binding",
    )
    w.flag(
        "--virtual-local-rank",
        "--virtual_local_rank",
        help="LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES = its own GPU",
    )
    w.value(
        "--event-log-handler",
        "--event_log_handler",
        default="null",
        help="null, or console: torchrun's agent events as JSON lines on stderr",
    )
    _add_rendezvous(_Options(p.add_argument_group("rendezvous"), environ))
    _add_logs(_Options(p.add_argument_group("logs"), environ))
    _Options(p.add_argument_group("diagnostics"), environ).value(
        "--timeline",
        default=None,
        pet=False,
        help="phalanx: every phalanx.Job of the workers records its timeline (phases, waits, "
        "collectives, clock offsets) into DIR, as PHALANX_TIMELINE_DIR; then `phalanx "
        "timeline DIR` merges them into one trace with each step's critical path",
    )
    s = _Options(p.add_argument_group("script"), environ)
    s.flag("-m", "--module", help="run the script as a Python module (python -m)")
    s.flag("--no-python", "--no_python", help="run the script as an executable, not with python")
    s.flag(
        "--run-path",
        "--run_path",
        help="run the script with runpy.run_path (takes precedence over --no-python)",
    )
    p.add_argument(
        "script", help="the training script (a module with -m, a program with --no-python)"
    )
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _add_rendezvous(r: _Options) -> None:
    r.value(
        "--rdzv-backend",
        "--rdzv_backend",
        default="static",
        help="static or c10d: both are phalanx's rendezvous over node 0's store",
    )
    r.value("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of node 0")
    r.value("--rdzv-id", "--rdzv_id", default="none", help="run id (default: generated)")
    r.value(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        help="KEY=VALUE,...: timeout / join_timeout (seconds to gather the nodes)",
    )
    r.value(
        "--rdzv-timeout",
        default=None,
        pet=False,
        help="phalanx: seconds to gather the nodes at each rendezvous (default 300)",
    )
    r.flag("--standalone", help="single node, store on loopback with a free port")
    r.value(
        "--node-rank",
        "--node_rank",
        default=None,
        help="rank of this node (default 0; with --rdzv-backend c10d on several nodes, taken at "
        "the rendezvous as torchrun does)",
    )
    r.value("--master-addr", "--master_addr", default=DEFAULT_MASTER_ADDR, help="node 0's host")
    r.value("--master-port", "--master_port", default=None, help="node 0's port (29500)")
    r.value(
        "--local-addr",
        "--local_addr",
        default=None,
        help="this node's address: gloo uses the interface that owns it",
    )
    r.value(
        "--backend",
        default=None,
        pet=False,
        help="phalanx: the workers' backend when they leave it to phalanx "
        "(phalanx.init_process_group(), phalanx.Job), passed as PHALANX_BACKEND. auto "
        "(default): nccl for GPU ranks, shm (shared memory) for CPU ranks all on one machine, "
        "or on several machines that each run 2 or more (shared memory inside each, gloo "
        "between them), else gloo. The start-up line says which backend the workers get",
    )


def _add_logs(g: _Options) -> None:
    g.value(
        "--log-dir",
        "--log_dir",
        default=None,
        help="base directory of the log files: <dir>/<run id>_<random>/attempt_<n>/"
        "<local rank>/{stdout,stderr}.log",
    )
    g.value(
        "-r",
        "--redirects",
        default="0",
        help="streams to files only: 0 none, 1 stdout, 2 stderr, 3 both, or 0:3,1:2,... "
        "per local rank",
    )
    g.value("-t", "--tee", default="0", help="streams to files and the console (as --redirects)")
    g.value(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        help="local ranks shown on the console, e.g. 0 or 0,1 (files keep every rank)",
    )
    g.value(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        default="",
        help="tee'd stdout lines containing any of these (comma-separated, ,, for a comma) "
        "also go to filtered_stdout.log",
    )
    g.value(
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        default="",
        help="the same for stderr (filtered_stderr.log)",
    )
    g.value(
        "--logs-specs",
        "--logs_specs",
        default=None,
        pet=False,
        help="name of a torchrun.logs_specs entry point that lays out the files instead",
    )
