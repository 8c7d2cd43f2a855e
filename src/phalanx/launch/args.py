"""Flags of ``phalanx run``: torchrun-compatible parsing and validation, as pure functions.

Nothing here touches the network or starts a process: :func:`parse_args` turns ``argv`` into a
frozen :class:`LaunchConfig` or raises :class:`ArgsError` naming the flag, the value and the fix.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["BACKENDS", "ArgsError", "LaunchConfig", "parse_args", "resolve_nproc"]

BACKENDS = ("auto", "gloo", "nccl", "mpi")
RDZV_BACKENDS = ("static", "c10d")
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class ArgsError(ValueError):
    """A flag of ``phalanx run`` has a value the launcher cannot use (exit code 2)."""


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``phalanx run`` was asked to do, validated."""

    nproc_per_node: int | None
    """Workers on this node; ``None`` means ``auto`` (CUDA devices, else 1)."""
    nnodes: int = 1
    """Number of nodes (agents) in the job; with ``--nnodes MIN:MAX`` the maximum."""
    min_nodes: int = 0
    """``--nnodes MIN:MAX``: a generation may start with MIN..MAX nodes (0: all ``nnodes``)."""
    node_rank: int = 0
    """Index of this node; node 0 hosts the rendezvous store."""
    master_addr: str = DEFAULT_MASTER_ADDR
    """Host of node 0's rendezvous store."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of node 0's rendezvous store (0: the OS picks one; only with --standalone)."""
    standalone: bool = False
    """Single node on loopback with an OS-chosen port."""
    rdzv_id: str | None = None
    """Run id shared by all nodes; node 0 generates one when not given."""
    rdzv_timeout: float = 300.0
    """Seconds to wait for the other nodes at each rendezvous."""
    max_restarts: int = 0
    """How many times all workers are restarted after a failure."""
    monitor_interval: float = 0.1
    """Seconds between two checks of the workers' health."""
    backend: str | None = None
    """Value of PHALANX_BACKEND for the workers (None: not set)."""
    module: bool = False
    """Run the script as a module (``python -m``)."""
    no_python: bool = False
    """Run the script as an executable, without the Python interpreter."""
    script: str = ""
    """Script path, module name (-m) or executable (--no-python)."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so parsing stays a pure function."""

    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = (
                "missing the script to run: phalanx run [flags] SCRIPT [ARGS...] "
                "(or -m MODULE, or --no-python EXECUTABLE)"
            )
        raise ArgsError(message)


def _build_parser() -> _Parser:
    p = _Parser(
        prog="phalanx run", description="Start N worker processes per node.", allow_abbrev=False
    )
    add = p.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|auto")
    add("--nnodes", default="1", metavar="N")
    add("--node-rank", "--node_rank", default="0", metavar="R")
    add("--master-addr", "--master_addr", default=None, metavar="HOST")
    add("--master-port", "--master_port", default=None, metavar="PORT")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT")
    add("--rdzv-backend", "--rdzv_backend", default="static", metavar="NAME")
    add("--rdzv-id", "--rdzv_id", default=None, metavar="ID")
    add("--rdzv-timeout", "--rdzv_timeout", default="300", metavar="SECONDS")
    add("--standalone", action="store_true")
    add("--max-restarts", "--max_restarts", default="0", metavar="N")
    add("--monitor-interval", "--monitor_interval", default="0.1", metavar="SECONDS")
    add("--backend", default=None, metavar="|".join(BACKENDS))
    add("-m", "--module", action="store_true", help="run the script as a Python module")
    add("--no-python", "--no_python", action="store_true")
    add("script", metavar="script")
    add("script_args", nargs=argparse.REMAINDER)
    return p


def _int(flag: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not an integer") from None
    if value < minimum:
        raise ArgsError(f"{flag} {value} is invalid: it must be at least {minimum}")
    return value


def _positive_float(flag: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ArgsError(f"{flag} {raw} is invalid: it must be a positive number of seconds")
    return value


def _port(flag: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ArgsError(f"{flag} {raw!r} is not a port number (1..65535)") from None
    if not 1 <= value <= 65535:
        raise ArgsError(f"{flag} {value} is outside the valid port range 1..65535")
    return value


def _nproc(raw: str) -> int | None:
    if raw == "auto":
        return None
    return _int("--nproc-per-node", raw, minimum=1)


def _nnodes(raw: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max)."""
    if ":" not in raw:
        n = _int("--nnodes", raw, minimum=1)
        return n, n
    low, _, high = raw.partition(":")
    lo, hi = _int("--nnodes", low, 1), _int("--nnodes", high, 1)
    if lo > hi:
        raise ArgsError(f"--nnodes {raw}: MIN={lo} is larger than MAX={hi}")
    return lo, hi


def _endpoint(raw: str) -> tuple[str, int]:
    """Split ``host:port``, ``[v6]:port`` or a bare host (default port) into host and port."""
    host, port = raw, str(DEFAULT_MASTER_PORT)
    if raw.startswith("["):
        close = raw.find("]")
        if close < 0:
            raise ArgsError(f"--rdzv-endpoint {raw!r}: missing ']' after the IPv6 address")
        host, rest = raw[1:close], raw[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ArgsError(f"--rdzv-endpoint {raw!r} is not of the form [HOST]:PORT")
            port = rest[1:]
    elif raw.count(":") == 1:
        host, port = raw.split(":")
    if not host:
        raise ArgsError(f"--rdzv-endpoint {raw!r} has no host; use HOST:PORT")
    return host, _port("--rdzv-endpoint", port)


def _master(ns: argparse.Namespace) -> tuple[str, int]:
    if ns.rdzv_endpoint:
        return _endpoint(ns.rdzv_endpoint)
    addr = ns.master_addr or DEFAULT_MASTER_ADDR
    port = DEFAULT_MASTER_PORT if ns.master_port is None else _port("--master-port", ns.master_port)
    return addr, port


def _check_choices(ns: argparse.Namespace) -> None:
    if ns.backend is not None and ns.backend not in BACKENDS:
        raise ArgsError(f"--backend {ns.backend!r} is not one of {', '.join(BACKENDS)}")
    if ns.rdzv_backend not in RDZV_BACKENDS:
        raise ArgsError(
            f"--rdzv-backend {ns.rdzv_backend!r} is not supported; use one of "
            f"{', '.join(RDZV_BACKENDS)} (phalanx runs its own rendezvous either way)"
        )
    if ns.module and ns.no_python:
        raise ArgsError("-m/--module and --no-python cannot be combined; pass only one")


def _min_nodes(raw: str) -> int:
    """MIN of an elastic ``--nnodes MIN:MAX``; 0 for a fixed number of nodes."""
    lo, hi = _nnodes(raw)
    return lo if lo < hi else 0


def _topology(ns: argparse.Namespace) -> tuple[int, int, str, int]:
    """Return nnodes (the maximum), node rank, master address and port, applying --standalone."""
    nnodes, node_rank = _nnodes(ns.nnodes)[1], _int("--node-rank", ns.node_rank, minimum=0)
    if ns.standalone:
        if nnodes != 1 or node_rank != 0:
            raise ArgsError(
                f"--standalone runs a single node, but --nnodes {ns.nnodes} --node-rank "
                f"{ns.node_rank} was given; drop --standalone or those flags"
            )
        return 1, 0, DEFAULT_MASTER_ADDR, 0
    if node_rank >= nnodes:
        raise ArgsError(
            f"--node-rank {node_rank} is invalid with --nnodes {nnodes}: node ranks are "
            f"0..{nnodes - 1}"
        )
    addr, port = _master(ns)
    return nnodes, node_rank, addr, port


def parse_args(argv: list[str]) -> LaunchConfig:
    """Parse and validate the flags of ``phalanx run`` (everything after ``run``).

    Raises:
        ArgsError: a flag is unknown, malformed or out of range, or the script is missing.
    """
    ns = _build_parser().parse_args(argv)
    _check_choices(ns)
    nnodes, node_rank, addr, port = _topology(ns)
    return LaunchConfig(
        nproc_per_node=_nproc(ns.nproc_per_node),
        nnodes=nnodes,
        min_nodes=_min_nodes(ns.nnodes),
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        standalone=ns.standalone,
        rdzv_id=ns.rdzv_id,
        rdzv_timeout=_positive_float("--rdzv-timeout", ns.rdzv_timeout),
        max_restarts=_int("--max-restarts", ns.max_restarts, minimum=0),
        monitor_interval=_positive_float("--monitor-interval", ns.monitor_interval),
        backend=ns.backend,
        module=ns.module,
        no_python=ns.no_python,
        script=ns.script,
        script_args=tuple(ns.script_args),
    )


def resolve_nproc(nproc_per_node: int | None, cuda_devices: int) -> int:
    """Workers on this node: the flag's value, or for ``auto`` the CUDA devices (or 1)."""
    if nproc_per_node is not None:
        return nproc_per_node
    return cuda_devices if cuda_devices > 0 else 1


def usage() -> str:
    """The usage line of ``phalanx run``."""
    return _build_parser().format_usage()
