"""What ``phalanx run`` was asked to do: frozen, validated configuration, no logic.

:func:`phalanx.launch.args.parse_args` builds a :class:`LaunchConfig` from torchrun's flags (and
phalanx's own); the agent, the worker environment and the log files each read the fields they
need.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_RDZV_TIMEOUT_S",
    "DEFAULT_SHUTDOWN_S",
    "DEFAULT_SIGNALS",
    "RECOVERY_MODES",
    "ArgsError",
    "LaunchConfig",
    "LogOptions",
    "StdSpec",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's ``--signals-to-handle`` default."""
DEFAULT_RDZV_TIMEOUT_S = 300.0
RECOVERY_MODES = ("restart", "live")
"""``--recovery``: the first is the default (see the option's help for why)."""
DEFAULT_SHUTDOWN_S = 3.0
"""phalanx's grace before SIGKILL (torchrun's is 30 s); --shutdown-timeout changes it."""


class ArgsError(ValueError):
    """A flag of ``phalanx run`` has a value the launcher cannot use (exit code 2)."""


@dataclass(frozen=True)
class StdSpec:
    """torchrun's ``--redirects`` / ``--tee`` value: 0 none, 1 stdout, 2 stderr, 3 both.

    Either one value for every local rank (``"3"``) or a value per local rank (``"0:3,1:1"``,
    where a local rank that is not named gets 0, as in torchrun).
    """

    value: int = 0
    """The value of every local rank (when ``per_rank`` is None)."""
    per_rank: tuple[tuple[int, int], ...] | None = None
    """``(local rank, value)`` pairs of the ``local_rank:value,...`` form."""

    def of(self, local_rank: int) -> int:
        """The 0..3 value of ``local_rank``."""
        if self.per_rank is None:
            return self.value
        return dict(self.per_rank).get(local_rank, 0)

    def ranks(self) -> list[int]:
        """Local ranks named by the ``local_rank:value`` form (empty for one value)."""
        return [rank for rank, _ in self.per_rank or ()]


@dataclass(frozen=True)
class LogOptions:
    """Where worker output goes: torchrun's ``--log-dir``, ``--redirects``, ``--tee``..."""

    log_dir: str | None = None
    """Base directory of the log files (None: a temporary directory, as torchrun does)."""
    redirects: StdSpec = StdSpec()
    """Streams written to files only."""
    tee: StdSpec = StdSpec()
    """Streams written to files and to the console."""
    local_ranks_filter: frozenset[int] | None = None
    """Local ranks shown on the console (None: all)."""
    duplicate_stdout_filters: tuple[str, ...] = ()
    """Tee'd stdout lines containing any of these also go to ``filtered_stdout.log``."""
    duplicate_stderr_filters: tuple[str, ...] = ()
    """Tee'd stderr lines containing any of these also go to ``filtered_stderr.log``."""
    logs_specs: str | None = None
    """Name of a ``torchrun.logs_specs`` entry point that decides the files instead."""
    prefix_template: str | None = None
    """TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: ``${rank}``, ``${local_rank}``, ``${role_name}``."""


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``phalanx run`` was asked to do, validated."""

    nproc_per_node: int
    """Workers on this node (``auto``, ``cpu`` and ``gpu`` already resolved, as torchrun does)."""
    nnodes: int = 1
    """Number of nodes (agents) in the job; with ``--nnodes MIN:MAX`` the maximum."""
    min_nodes: int = 0
    """``--nnodes MIN:MAX``: a generation may start with MIN..MAX nodes (0: all ``nnodes``)."""
    node_rank: int = 0
    """Index of this node; node 0 hosts the rendezvous store."""
    node_rank_auto: bool = False
    """No ``--node-rank`` under ``--rdzv-backend c10d`` (torchrun's form): the agent that hosts
    the store is node 0, the others take a free rank there (``node_rank`` is 0 until then)."""
    master_addr: str = DEFAULT_MASTER_ADDR
    """Host of node 0's rendezvous store."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of node 0's rendezvous store (0: the OS picks one, on a single node)."""
    standalone: bool = False
    """Single node on loopback with an OS-chosen port."""
    rdzv_backend: str = "static"
    """``static`` or ``c10d``: both mean phalanx's rendezvous over node 0's store."""
    rdzv_id: str | None = None
    """Run id shared by all nodes; node 0 generates one when not given."""
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT_S
    """Seconds to wait for the other nodes at each rendezvous."""
    max_restarts: int = 0
    """Restart mode: how many times all workers are restarted after a failure. Live mode: how
    many single workers are replaced, counted over the whole job (every slot, every node)."""
    recovery: str = "restart"
    """``restart``: a failure stops and restarts every worker. ``live``: only the dead worker
    is replaced, the others keep running (:mod:`phalanx.launch.live`)."""
    monitor_interval: float = 0.1
    """Seconds between two checks of the workers' health."""
    shutdown_timeout: float = DEFAULT_SHUTDOWN_S
    """Seconds between the stop signal and SIGKILL when workers are stopped."""
    signals_to_handle: tuple[int, ...] = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    """Signals the launcher catches and forwards to the workers before stopping them."""
    signals_text: str = DEFAULT_SIGNALS
    """``--signals-to-handle`` as given (TORCHELASTIC_SIGNALS_TO_HANDLE of the workers)."""
    backend: str | None = None
    """Value of PHALANX_BACKEND for the workers (None: not set)."""
    timeline_dir: str | None = None
    """``--timeline``, made absolute: PHALANX_TIMELINE_DIR of the workers (None: not set)."""
    role: str = "default"
    """ROLE_NAME of the workers (``--role``)."""
    local_addr: str | None = None
    """This node's address: gloo uses the interface that owns it (GLOO_SOCKET_IFNAME)."""
    numa_binding: str | None = None
    """torchrun's ``--numa-binding`` mode, applied per local rank's GPU."""
    virtual_local_rank: bool = False
    bind_cores: bool = False
    """``--bind-cores``: each worker pinned to a block of the node's cores (:mod:`.cores`)."""
    """LOCAL_RANK=0 for every worker, each seeing only its own GPU (CUDA_VISIBLE_DEVICES)."""
    start_method: str = "spawn"
    """torchrun's ``--start-method`` (phalanx starts every worker as a fresh process)."""
    event_log_handler: str = "null"
    """``null`` or ``console``: torchrun's agent events as JSON lines on stderr."""
    logs: LogOptions = field(default_factory=LogOptions)
    """Log files, redirects, tee and the console filter."""
    python: str = sys.executable
    """Interpreter of the workers (torchrun's PYTHON_EXEC, else this one)."""
    module: bool = False
    """Run the script as a module (``python -m``)."""
    no_python: bool = False
    """Run the script as an executable, without the Python interpreter."""
    run_path: bool = False
    """Run the script with ``runpy.run_path`` (torchrun's ``--run-path``)."""
    script: str = ""
    """Script path, module name (-m) or executable (--no-python)."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script."""
