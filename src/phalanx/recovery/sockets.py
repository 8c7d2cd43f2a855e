"""Cut the connections of a broken gloo group so that peers blocked on this process fail at once.

gloo closes a group's TCP connections only when its ``ProcessGroupGloo`` object is freed, and
``destroy_process_group()`` does not free it while anything else holds it: the traceback of the
exception that reported the failure, a DDP module, a bucket engine. A peer blocked in a
collective that waits for this process would then wait for its whole collective timeout, since
gloo's ``abort()`` does nothing. So the sockets a group opened are noted when it is built (the
socket descriptors of ``/proc/self/fd`` that appeared during ``init_process_group``) and shut
down (``shutdown(SHUT_RDWR)`` on a duplicate; gloo still owns and later closes the original;
the listening socket is left alone: gloo's accept thread aborts the process when it fails)
when the group is abandoned: every peer still waiting on this process reads "connection closed"
within milliseconds and starts its own recovery. Without ``/proc`` (not Linux) nothing is cut,
and such peers notice at their collective timeout (logged once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

__all__ = ["GroupSockets", "socket_fds"]

log = logging.getLogger(__name__)
_FD_DIR = "/proc/self/fd"


def socket_fds() -> dict[int, str]:
    """This process's open socket descriptors and their inode links (``socket:[n]``)."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    out = {}
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"{_FD_DIR}/{name}")
            if link.startswith("socket:"):
                out[int(name)] = link
    return out


@dataclass
class GroupSockets:
    """The sockets one process group opened in this process."""

    fds: dict[int, str] = field(default_factory=dict)

    @classmethod
    def opened_since(cls, before: dict[int, str]) -> GroupSockets:
        """The socket descriptors open now that were not open (as the same socket) ``before``."""
        if not os.path.isdir(_FD_DIR):
            log.warning(
                "no %s on this system: when a member fails, peers blocked on this process "
                "notice only at their collective timeout",
                _FD_DIR,
            )
        return cls({fd: link for fd, link in socket_fds().items() if before.get(fd) != link})

    def cut(self) -> int:
        """Shut down every noted socket that is still the same socket; how many were cut."""
        cut = 0
        for fd, link in self.fds.items():
            with contextlib.suppress(OSError):
                if os.readlink(f"{_FD_DIR}/{fd}") != link:
                    continue  # closed, and the number reused by something else
                with socket.socket(fileno=os.dup(fd)) as dup:
                    if dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # gloo's listener: shutting it down aborts the process
                    dup.shutdown(socket.SHUT_RDWR)
                    cut += 1
        self.fds = {}
        return cut
