"""``phalanx doctor``: what this machine offers a distributed job, and what will go wrong.

Checks torch's version and build, the c10d backends, GPUs, network interfaces and which one the
rendezvous would use, host-name resolution (a host name resolving to 127.0.1.1 makes gloo bind
loopback, so other machines cannot connect), and whether the master port is free.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from phalanx.comm.store import bind_listener
from phalanx.launch.netif import interface_for, ipv4_interfaces

__all__ = ["Check", "main", "run_checks"]


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str
    """"ok", "warn" or "fail"."""
    detail: str


def _torch_check() -> Check:
    cuda = torch.version.cuda or "none (CPU build)"
    return Check("torch", "ok", f"{torch.__version__}, CUDA {cuda}")


def _backend_checks() -> list[Check]:
    found = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    status = "ok" if found["gloo"] else "fail"
    detail = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items())
    return [Check("backends", status, detail)]


def _gpu_check() -> Check:
    if not torch.cuda.is_available():
        return Check("gpus", "ok", "none visible: gloo on CPU will be used")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("gpus", "ok", f"{len(names)}: " + "; ".join(names))


def _network_checks(master_addr: str) -> list[Check]:
    ifaces = ipv4_interfaces()
    checks = [Check("interfaces", "ok", ", ".join(f"{n} {ip}" for n, ip in ifaces) or "none")]
    chosen = interface_for(master_addr)
    pinned = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen is None:
        checks.append(Check("route", "fail", f"no route to master address {master_addr}"))
    else:
        note = f" (GLOO_SOCKET_IFNAME={pinned} overrides it)" if pinned else ""
        checks.append(Check("route", "ok", f"to {master_addr} via {chosen[0]} ({chosen[1]}){note}"))
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        ips = sorted({str(i[4][0]) for i in infos})
    except OSError as exc:
        return [*checks, Check("hostname", "warn", f"{host} does not resolve ({exc})")]
    loop = all(ip.startswith("127.") or ip == "::1" for ip in ips)
    detail = f"{host} -> {', '.join(ips)}"
    if loop:
        detail += "; multi-machine jobs need GLOO_SOCKET_IFNAME (phalanx run sets it)"
    return [*checks, Check("hostname", "warn" if loop else "ok", detail)]


def _port_check(addr: str, port: int) -> Check:
    try:
        bind_listener(addr, port).close()
    except OSError as exc:
        return Check("port", "fail", exc.strerror or str(exc))
    return Check("port", "ok", f"{addr}:{port} is free")


def run_checks(master_addr: str = "127.0.0.1", master_port: int = 29500) -> list[Check]:
    """Run every check; pure reporting, nothing is changed."""
    return [
        _torch_check(),
        *_backend_checks(),
        _gpu_check(),
        *_network_checks(master_addr),
        _port_check(master_addr, master_port),
    ]


def main(argv: list[str]) -> int:
    """``phalanx doctor [--master-addr A] [--master-port P] [--json]``; exit 1 on a failure."""
    parser = argparse.ArgumentParser(prog="phalanx doctor")
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port must be in 1..65535, got {args.master_port}")
    checks = run_checks(args.master_addr, args.master_port)
    if args.json:
        print(json.dumps([asdict(c) for c in checks]))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<10} {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0
