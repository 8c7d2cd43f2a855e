"""``phalanx doctor``: what this machine offers a distributed job, and what will go wrong.

Checks torch's version and build, the c10d backends, whether the shared-memory backend can run
here (the platform, a ``memfd`` peers can open through ``/proc``, ``/dev/shm`` and its free
space), which backend a job would get, GPUs, network interfaces and which one gloo would use,
host-name resolution (a host name resolving to 127.0.1.1 makes gloo bind loopback, so other
machines cannot connect), and whether the master port is free.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from phalanx.comm.backends import auto_backend, shm_unusable
from phalanx.comm.netif import GLOO_IFNAME, gloo_interface, interface_for, ipv4_interfaces
from phalanx.comm.shm.segment_file import SHM_DIR
from phalanx.comm.store import bind_listener

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


SMALL_SHM = 64 * 2**20
"""Below this much free space, ``/dev/shm`` is a container's default (``docker run``: 64 MiB)."""


def _memfd() -> str | None:
    """None when a memfd can be made and opened again through ``/proc`` (as the shm backend's
    peers open rank 0's segment), else why not."""
    if not hasattr(os, "memfd_create"):
        return "this Python has no os.memfd_create"
    try:
        fd = os.memfd_create("phalanx-doctor", os.MFD_CLOEXEC)
    except OSError as exc:
        return f"memfd_create failed: {exc.strerror or exc}"
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"/proc/<pid>/fd/<n> cannot be opened: {exc.strerror or exc}"
    finally:
        os.close(fd)
    return None


def _dev_shm() -> tuple[str | None, int]:
    """(None, free bytes) when ``/dev/shm`` takes a file, else (why not, 0)."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist", 0
    try:
        with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="phalanx-doctor-"):
            pass
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR} is not writable ({exc.strerror or exc})", 0
    return None, st.f_bavail * st.f_frsize


def _shm_check() -> Check:
    """Can the shared-memory backend run here, and with what."""
    cannot = shm_unusable()
    if cannot is not None:
        return Check("shm", "warn", f"cannot run on {cannot}: CPU ranks use gloo")
    memfd, (dev_shm, free) = _memfd(), _dev_shm()
    space = "" if dev_shm else f"{SHM_DIR} writable, {free / 2**20:.0f} MiB free"
    if memfd is None:
        detail = "usable: segments are memfds (they count against memory, not /dev/shm)"
        return Check("shm", "ok", f"{detail}; {space or dev_shm}")
    if dev_shm is not None:
        return Check(
            "shm",
            "fail",
            f"not usable: {memfd}, and {dev_shm}; pass --backend gloo (PHALANX_BACKEND=gloo)",
        )
    status = "warn" if free < SMALL_SHM else "ok"
    hint = " (docker run --shm-size raises it)" if status == "warn" else ""
    return Check("shm", status, f"usable with files in {SHM_DIR} ({memfd}); {space}{hint}")


def _default_backend_check() -> Check:
    """Which backend a job that leaves it to phalanx would get on this machine."""
    chosen = os.environ.get("PHALANX_BACKEND", "")
    if chosen and chosen.lower() != "auto":
        return Check("default", "ok", f"{chosen.lower()} (PHALANX_BACKEND={chosen} is set)")
    gpu = torch.cuda.is_available()
    here, why = auto_backend(gpu, one_machine=True)
    if gpu:
        return Check("default", "ok", f"{here} ({why})")
    # across machines, shm (hierarchical) needs phalanx run's word that each runs 2 or more
    across = auto_backend(gpu, one_machine=False, fewest_local=2)[0]
    because = "" if here == "shm" else f" ({why})"
    machines = f"{across} across machines"
    if across == "shm":
        machines = (
            "shm across machines that each run 2 or more (hierarchical, under phalanx run), "
            "else gloo"
        )
    return Check(
        "default",
        "ok",
        f"backend {here} when every rank runs on this machine{because}, {machines}; "
        "--backend / PHALANX_BACKEND choose another",
    )


def _gpu_check() -> Check:
    if not torch.cuda.is_available():
        return Check("gpus", "ok", "none visible: ranks compute on the CPU")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("gpus", "ok", f"{len(names)}: " + "; ".join(names))


def _network_checks(master_addr: str) -> list[Check]:
    ifaces = ipv4_interfaces()
    checks = [Check("interfaces", "ok", ", ".join(f"{n} {ip}" for n, ip in ifaces) or "none")]
    chosen = interface_for(master_addr)
    if chosen is None:
        checks.append(Check("route", "fail", f"no route to master address {master_addr}"))
    else:
        pinned = gloo_interface(os.environ, master_addr)
        note = (
            f"gloo uses {pinned}"
            if pinned
            else f"{GLOO_IFNAME}={os.environ.get(GLOO_IFNAME, '')!r} overrides it"
        )
        checks.append(
            Check("route", "ok", f"to {master_addr} via {chosen[0]} ({chosen[1]}); {note}")
        )
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        ips = sorted({str(i[4][0]) for i in infos})
    except OSError as exc:
        return [*checks, Check("hostname", "warn", f"{host} does not resolve ({exc})")]
    loop = all(ip.startswith("127.") or ip == "::1" for ip in ips)
    detail = f"{host} -> {', '.join(ips)}"
    if loop:
        detail += (
            "; gloo would bind loopback: phalanx (phalanx run, phalanx.init_process_group) "
            "sets GLOO_SOCKET_IFNAME to the interface that routes to the master"
        )
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
        _shm_check(),
        _default_backend_check(),
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
