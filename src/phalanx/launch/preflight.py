"""Checks before anything is spawned: the master resolves, and is reachable or can be hosted.

torchrun discovers an unresolvable or unreachable master after its 126 s of retries; these
checks fail in at most 5 s with a message naming the host, the port and what to do.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["PreflightError", "resolve_host", "wait_for_master"]

RESOLVE_DEADLINE_S = 5.0
CONNECT_DEADLINE_S = 5.0
WAIT_MESSAGE_EVERY_S = 10.0


class PreflightError(RuntimeError):
    """The job cannot start on this node; the message says why and what to change."""


def resolve_host(host: str, deadline: float = RESOLVE_DEADLINE_S) -> list[str]:
    """Resolve ``host`` to its addresses within ``deadline`` seconds.

    getaddrinfo cannot be cancelled, so it runs in a daemon thread that is abandoned on timeout.

    Raises:
        PreflightError: the host does not resolve, or the resolver did not answer in time.
    """
    result: list[object] = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=lookup, name="phalanx-resolve", daemon=True)
    thread.start()
    thread.join(deadline)
    if not result:
        raise PreflightError(
            f"the master host {host!r} did not resolve within {deadline:.0f} s (DNS is not "
            f"answering); pass an IP address with --master-addr or fix the resolver"
        )
    answer = result[0]
    if isinstance(answer, OSError):
        raise PreflightError(
            f"the master host {host!r} does not resolve ({answer.strerror or answer}); "
            f"check the spelling of --master-addr / --rdzv-endpoint or use an IP address"
        )
    assert isinstance(answer, list)
    return sorted({str(info[4][0]) for info in answer})


def _try_connect(host: str, port: int) -> int | None:
    """Connect once; return None on success or the errno of the failure."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_DEADLINE_S):
            return None
    except TimeoutError:
        return errno.ETIMEDOUT
    except OSError as exc:
        return exc.errno or errno.EIO


_REASONS = {
    errno.EHOSTUNREACH: "no route to host (EHOSTUNREACH)",
    errno.ENETUNREACH: "network is unreachable (ENETUNREACH)",
    errno.ETIMEDOUT: (
        f"no answer within {CONNECT_DEADLINE_S:.0f} s (the host is down, or a firewall drops "
        f"the packets)"
    ),
}


def _unreachable(host: str, port: int, code: int) -> PreflightError:
    why = _REASONS.get(code) or f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    return PreflightError(
        f"cannot reach the master {host}:{port}: {why}; check --master-addr / --rdzv-endpoint, "
        f"the network between the nodes, and firewalls"
    )


def wait_for_master(
    host: str,
    port: int,
    timeout: float,
    log: Callable[[str], None],
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Wait until node 0's rendezvous store accepts connections at ``host:port``.

    "Connection refused" means the host is up but node 0 has not started yet: retry until
    ``timeout`` (--rdzv-timeout), logging every ~10 s. Unreachable or silent hosts fail at once.

    Raises:
        PreflightError: the host is unreachable, or node 0 did not start within ``timeout``.
    """
    start = time.monotonic()
    next_message = start + WAIT_MESSAGE_EVERY_S
    while not stopped():
        code = _try_connect(host, port)
        if code is None:
            return
        if code != errno.ECONNREFUSED:
            raise _unreachable(host, port, code)
        now = time.monotonic()
        if now - start >= timeout:
            raise PreflightError(
                f"node 0 did not start its rendezvous store at {host}:{port} within "
                f"--rdzv-timeout {timeout:.0f} s (connection refused); start node 0 with the "
                f"same --master-addr/--master-port, or raise --rdzv-timeout"
            )
        if now >= next_message:
            log(f"waiting for node 0 at {host}:{port} ({now - start:.0f} s of {timeout:.0f} s)")
            next_message = now + WAIT_MESSAGE_EVERY_S
        time.sleep(0.2)
