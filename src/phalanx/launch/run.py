"""``phalanx run``: parse the flags, run the preflight checks, hand over to the node agent."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
from datetime import timedelta
from typing import Any

from phalanx.comm import tcpstore
from phalanx.comm.auth import SECRET_ENV
from phalanx.comm.netif import interface_owning
from phalanx.launch.args import ArgsError, LaunchConfig, notes, parse_args
from phalanx.launch.cores import available_cores, core_blocks, describe
from phalanx.launch.logs import load_logs_specs
from phalanx.launch.output import CONSOLE
from phalanx.launch.preflight import PreflightError, resolve_host, wait_for_master

__all__ = ["main"]


def _log(message: str) -> None:
    CONSOLE.line("stderr", f"phalanx run: {message}")


def _open_agent_store(cfg: LaunchConfig, addrs: list[str]) -> tuple[Any, LaunchConfig]:
    """Node 0 hosts the agent store on exactly the master address; other nodes connect to it.

    Without --node-rank (torchrun's c10d form), an agent on the machine that owns the address
    hosts the store and is node 0, unless another agent here already does; the others connect
    and take a node rank at the rendezvous (:class:`~phalanx.launch.agent.Agent`).
    """
    timeout = timedelta(seconds=cfg.rdzv_timeout)
    addr = cfg.master_addr
    hosts = _ours(addrs) if cfg.node_rank_auto else cfg.node_rank == 0
    if hosts:
        try:
            store, port = tcpstore.host(addr, cfg.master_port, timeout)
        except OSError as exc:
            if not (cfg.node_rank_auto and exc.errno == errno.EADDRINUSE):
                raise PreflightError(
                    f"node 0 cannot host the rendezvous store on {addr}:{cfg.master_port}: "
                    f"{exc.strerror or exc}"
                ) from None
        else:
            _log(f"node 0 of {cfg.nnodes}: rendezvous store listening on {addr}:{port}")
            return store, dataclasses.replace(cfg, node_rank=0, node_rank_auto=False)
    wait_for_master(addr, cfg.master_port, cfg.rdzv_timeout, _log)
    try:
        return tcpstore.connect(addr, cfg.master_port, timeout), cfg
    except ConnectionError as exc:
        raise PreflightError(str(exc)) from None


def _ours(addrs: list[str]) -> bool:
    """Whether one of ``addrs`` (the master address, resolved) belongs to this machine."""
    return any(
        ipaddress.ip_address(a.split("%")[0]).is_loopback or interface_owning(a) is not None
        for a in addrs
    )


def _warn_if_loopback(cfg: LaunchConfig, addrs: list[str]) -> None:
    """A multi-node master on loopback (e.g. a hostname mapped to 127.0.1.1) is unreachable."""
    if cfg.node_rank != 0 or cfg.node_rank_auto or cfg.nnodes == 1:
        return
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        _log(
            f"warning: --master-addr {cfg.master_addr} resolves to {', '.join(addrs)} here, a "
            f"loopback address that the other {cfg.nnodes - 1} node(s) cannot reach; pass an "
            f"address of this machine that they can reach"
        )


def _check_local(cfg: LaunchConfig) -> None:
    """What the flags need from this machine: --local-addr is ours, --logs-specs installed,
    --log-dir writable."""
    if cfg.local_addr is not None and interface_owning(cfg.local_addr) is None:
        raise PreflightError(
            f"--local-addr {cfg.local_addr} is not an address of this machine; pass one of its "
            f"addresses (see `phalanx doctor`) or drop --local-addr"
        )
    if cfg.logs.logs_specs is not None:
        load_logs_specs(cfg.logs.logs_specs)
    log_dir = cfg.logs.log_dir
    if log_dir is not None and log_dir != os.devnull:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise PreflightError(f"--log-dir {log_dir} cannot be created: {exc.strerror}") from None
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise PreflightError(f"--log-dir {log_dir} is not writable by this user")


def _say_defaults(cfg: LaunchConfig) -> None:
    for note in notes(cfg):
        _log(f"warning: {note}")
    if cfg.bind_cores:
        cores = available_cores()
        blocks = core_blocks(cores, cfg.nproc_per_node)
        threads = "" if "OMP_NUM_THREADS" in os.environ else ", OMP_NUM_THREADS = its core count"
        _log(f"--bind-cores: each worker pinned to its cores, {describe(blocks)}{threads}")
        if len(cores) < cfg.nproc_per_node:
            _log(
                f"warning: --bind-cores: {cfg.nproc_per_node} workers on {len(cores)} core(s): "
                f"workers share cores"
            )
    elif cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        _log(
            f"OMP_NUM_THREADS=1 for each of the {cfg.nproc_per_node} workers, as torchrun sets "
            f"it; set OMP_NUM_THREADS to give each worker more threads"
        )


def _warn_without_secret(cfg: LaunchConfig, addrs: list[str]) -> None:
    """Several machines, a reachable master, no secret: anyone on the network is trusted."""
    if os.environ.get(SECRET_ENV) or cfg.nnodes == 1:  # one machine: the launcher makes one
        return
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return
    _log(
        f"warning: {SECRET_ENV} is not set, so this job's rendezvous values are unsigned: any "
        f"process that reaches {cfg.master_addr}:{cfg.master_port} can join the job or forge "
        f"its failures and checkpoint answers. Set the same {SECRET_ENV} on every node, e.g. "
        f"from `python -c 'import secrets; print(secrets.token_hex(32))'` (docs/security.md)"
    )


def main(argv: list[str]) -> int:
    """Run ``phalanx run`` with ``argv`` (the arguments after ``run``); return the exit code.

    Exit codes: 0 success; 2 bad flags; 1 preflight or rendezvous failure; otherwise the first
    failing worker's exit code (128 + N for signal N), or 128 + N when the launcher got signal N.
    """
    try:
        cfg = parse_args(argv)
        _check_local(cfg)
    except ArgsError as exc:
        _log(f"error: {exc}")
        _log("every option: phalanx run --help")
        return 2
    except PreflightError as exc:
        _log(f"error: {exc}")
        return 1
    _say_defaults(cfg)
    try:
        addrs = resolve_host(cfg.master_addr)
        _warn_if_loopback(cfg, addrs)
        _warn_without_secret(cfg, addrs)
        store, cfg = _open_agent_store(cfg, addrs)
    except PreflightError as exc:
        _log(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
    from phalanx.launch.agent import Agent

    return Agent(cfg, store, _log).run()
