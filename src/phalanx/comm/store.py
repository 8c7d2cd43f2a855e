"""Rendezvous stores: host a TCPStore bound to one address, or connect to one.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host``
says, and has no authentication. phalanx binds the listening socket itself, to the address it
was given, and hands the bound socket to the store (``master_listen_fd``). torch is imported
by the functions that make its stores only: :mod:`phalanx.comm.tcpstore` binds and waits with
the others, without torch.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["bind_listener", "connect_store", "host_store", "unreachable", "wait_for_listener"]

POLL_S = 0.1
"""Pause between two connection attempts while nothing listens yet."""


def bind_listener(addr: str, port: int) -> socket.socket:
    """Open a listening TCP socket on exactly ``addr:port`` (port 0: the OS picks one).

    Raises:
        ValueError: the port is out of range.
        OSError: with a message naming the address and port when it is in use or not local.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                exc.errno,
                f"port {port} on {addr} is already in use; choose another port "
                f"(--master-port) or stop the process that holds it",
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(
                exc.errno,
                f"address {addr} is not an address of this machine, so the rendezvous store "
                f"cannot listen on it; on the master node pass one of its own addresses",
            ) from None
        raise
    return sock


def host_store(addr: str, port: int, timeout: timedelta) -> tuple[dist.TCPStore, int]:
    """Start a TCPStore server listening only on ``addr:port``; return it and its port."""
    import torch.distributed as dist

    sock = bind_listener(addr, port)
    bound_port = sock.getsockname()[1]
    # The store uses this very descriptor (no dup) and closes it when it is destroyed, so hand
    # over ownership: a Python socket object left holding it would close it a second time.
    fd = sock.detach()
    try:
        store = dist.TCPStore(
            addr,
            bound_port,
            None,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    return store, bound_port


def connect_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Connect a TCPStore client to ``addr:port`` within ``timeout``, naming both on failure.

    torch's client alone overruns its timeout: its first connect attempt already waits the whole
    timeout, and its retry loop then sleeps a randomised backoff and tries again, so
    ``timeout=5`` gave up after 7 to 12 s. Here a plain socket polls until the deadline, and the
    store connects only once something listens (at once, then).
    """
    import torch.distributed as dist

    wait_for_listener(addr, port, timeout)
    try:
        return dist.TCPStore(addr, port, None, False, timeout)
    except (RuntimeError, OSError) as exc:
        raise unreachable(addr, port, timeout, exc) from exc


def wait_for_listener(addr: str, port: int, timeout: timedelta) -> None:
    """Return once something accepts connections on ``addr:port``; ``ConnectionError`` naming
    both after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    last: OSError | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((addr, port), timeout=min(left, 1.0)):
                return
        except OSError as exc:  # refused, unreachable, a name that does not resolve (yet)
            last = exc
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    raise unreachable(addr, port, timeout, last)


def unreachable(
    addr: str, port: int, timeout: timedelta, cause: BaseException | None
) -> ConnectionError:
    """The error for a store at ``addr:port`` that did not answer within ``timeout``."""
    why = f" (last error: {str(cause).strip()[:200]})" if cause is not None else ""
    return ConnectionError(
        f"could not connect to the rendezvous store at {addr}:{port} within "
        f"timeout={timeout.total_seconds():g} s{why}; check that rank 0 / node 0 is running "
        f"and that MASTER_ADDR / MASTER_PORT (or the init_method) point at it, or raise timeout="
    )
