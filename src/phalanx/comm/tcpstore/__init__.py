"""torch's TCPStore, both ends, in pure Python: for the processes that must not import torch.

``phalanx run``'s agents host the stores that the workers' torch clients join
(``TCPStore(..., is_master=False)``), and use them themselves. ``import torch`` was 1.45 of a
launcher's 1.8 CPU-seconds; with these, a launcher on a machine without GPUs never imports it.
:func:`host` is ``TCPStore(addr, port, is_master=True)`` bound to exactly ``addr``
(:func:`phalanx.comm.store.bind_listener`), :func:`connect` is a client that waits for the
server within the timeout. ``wire`` has the protocol, ``server`` and ``client`` its two ends.
"""

from __future__ import annotations

from datetime import timedelta

from phalanx.comm.store import bind_listener, unreachable, wait_for_listener
from phalanx.comm.tcpstore.client import StoreClient, StoreTimeout
from phalanx.comm.tcpstore.server import StoreServer

__all__ = ["StoreClient", "StoreServer", "StoreTimeout", "connect", "host"]


def host(addr: str, port: int, timeout: timedelta) -> tuple[StoreClient, int]:
    """Serve a store on exactly ``addr:port`` (0: the OS picks); return a client and the port.

    The server lives as long as the client (as torch's master store does) or until its
    ``close()``.
    """
    server = StoreServer(bind_listener(addr, port))
    try:
        return StoreClient(addr, server.port, timeout, server=server), server.port
    except BaseException:
        server.close()
        raise


def connect(addr: str, port: int, timeout: timedelta) -> StoreClient:
    """A client of the store at ``addr:port``, once something listens there (within
    ``timeout``; ``ConnectionError`` naming both otherwise)."""
    wait_for_listener(addr, port, timeout)
    try:
        return StoreClient(addr, port, timeout)
    except OSError as exc:
        raise unreachable(addr, port, timeout, exc) from exc
