"""``phalanx doctor``: what this machine offers a distributed job, and what will go wrong.

Checks torch's version and build, the c10d backends, whether the shared-memory backend can run
here (the platform, a ``memfd`` peers can open through ``/proc``, ``/dev/shm`` and its free
space), which backend ``phalanx run`` gives the workers and why (the launcher's own decision,
for the job of ``--nproc-per-node`` / ``--nnodes`` / ``--backend`` when given), GPUs, network
interfaces and which one gloo would use, host-name resolution (a host name resolving to
127.0.1.1 makes gloo bind loopback, so other machines cannot connect), and whether the master
port is free.
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

from phalanx.comm.backends import BACKENDS, shm_unusable
from phalanx.comm.netif import GLOO_IFNAME, gloo_interface, interface_for, ipv4_interfaces
from phalanx.comm.shm.segment_file import SHM_DIR
from phalanx.comm.store import bind_listener
from phalanx.launch.backend_note import describe, workers_backend
from phalanx.launch.config import ArgsError
from phalanx.launch.nproc import local_world_size, probe_devices

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


def _run_backend_check(
    backend: str | None = None, nproc: int | None = None, nnodes: int | None = None
) -> Check:
    """What backend ``phalanx run`` gives workers that leave it to phalanx, and why.

    The launcher's own decision (:func:`~phalanx.launch.backend_note.workers_backend`) in its
    start-up line's words, for the job of ``--nproc-per-node`` / ``--nnodes`` when either is
    given, else for one machine and for several (each like this one)."""
    if nproc is not None or nnodes is not None:
        nproc, nnodes = nproc or 1, nnodes or 1
        chosen = workers_backend(backend, nproc * nnodes, nproc, fewest_local=nproc)
        flags = f"--nproc-per-node {nproc} --nnodes {nnodes}"
        return _run_check(f"phalanx run {flags}: {_said(backend, *chosen)}", chosen[0])
    one = workers_backend(backend, 2, 2)
    if one[2] or one[0] == "nccl":  # named by the user, or GPU ranks: the same everywhere
        return _run_check(_said(backend, *one), one[0])
    across = workers_backend(backend, 4, 2, fewest_local=2)  # 2 machines, 2 ranks each
    single = workers_backend(backend, 2, 1, fewest_local=1)  # 2 machines, 1 rank each
    if across[0] == single[0] == one[0]:
        machines = f"{one[0]} across machines too"
    else:
        machines = (
            f"across machines: {across[0]} when each runs 2 or more ({across[1]}), else {single[0]}"
        )
    return _run_check(f"{_said(backend, *one)}; {machines}", one[0])


def _run_check(detail: str, name: str) -> Check:
    """The answer, failed where ``phalanx run`` would refuse it: shm named (``--backend shm``,
    ``PHALANX_BACKEND=shm``) where shm cannot run."""
    cannot = shm_unusable() if name == "shm" else None
    if cannot is None:
        return Check("run", "ok", detail)
    return Check("run", "fail", f"{detail}; refused: shm cannot run on {cannot}")


def _said(backend: str | None, name: str, why: str, chosen: bool) -> str:
    """:func:`~phalanx.launch.backend_note.describe`, saying who chose the backend."""
    if chosen:
        source = f"--backend {backend}" if backend else f"PHALANX_BACKEND is {name}"
        why = f"{source}: {why}" if why else source
    return describe(name, why, chosen)


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


def run_checks(
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    backend: str | None = None,
    nproc: int | None = None,
    nnodes: int | None = None,
) -> list[Check]:
    """Run every check; pure reporting, nothing is changed. ``backend``, ``nproc`` and
    ``nnodes`` are ``phalanx run``'s ``--backend``, ``--nproc-per-node`` and ``--nnodes``."""
    return [
        _torch_check(),
        *_backend_checks(),
        _shm_check(),
        _run_backend_check(backend, nproc, nnodes),
        _gpu_check(),
        *_network_checks(master_addr),
        _port_check(master_addr, master_port),
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx doctor",
        description="What this machine offers a distributed job, and which backend `phalanx "
        "run` gives its workers and why. Exit 1 when a check fails.",
    )
    parser.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="node 0's address, as phalanx run's (default: MASTER_ADDR, else 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port", type=int, default=29500, help="checked free there (default 29500)"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        type=str.lower,
        help="as phalanx run's: what the workers get with it (default: auto)",
    )
    parser.add_argument(
        "--nproc-per-node",
        metavar="N|cpu|gpu|auto",
        help="as phalanx run's: the backend of that job (default: one machine and several)",
    )
    parser.add_argument("--nnodes", type=int, help="as phalanx run's, a number of machines")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser


def main(argv: list[str]) -> int:
    """``phalanx doctor [--master-addr A] [--master-port P] [--backend B] [--nproc-per-node N]
    [--nnodes M] [--json]``; exit 1 on a failure."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.nnodes is not None and args.nnodes < 1:
        parser.error(f"--nnodes must be >= 1, got {args.nnodes}")
    nproc = None
    if args.nproc_per_node is not None:
        try:
            nproc = local_world_size(args.nproc_per_node, probe_devices)
        except ArgsError as exc:
            parser.error(str(exc))
        if nproc < 1:
            parser.error(f"--nproc-per-node must be >= 1, got {nproc}")
    checks = run_checks(args.master_addr, args.master_port, args.backend, nproc, args.nnodes)
    if args.json:
        print(json.dumps([asdict(c) for c in checks]))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<10} {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0
