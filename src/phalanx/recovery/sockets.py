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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["GroupSockets", "InitWatch", "abandon_group", "socket_fds"]

log = logging.getLogger(__name__)
_FD_DIR = "/proc/self/fd"
WATCH_S = 0.05


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


def abandon_group(sockets: GroupSockets) -> None:
    """Abandon this process's default group: cut its connections, destroy it.

    When ``init_process_group`` itself failed there is no group to destroy, but torch has
    already counted it: the default group's name, which prefixes its rendezvous keys, is that
    count. ``destroy_process_group()`` resets it to 0; a failed init does not. So it is reset
    here, or this member's next group would wait on keys (``.../1/...``) that a peer whose
    last group formed writes under another name (``.../0/...``), in every generation after.
    """
    sockets.cut()
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._world.group_count = 0


class InitWatch:
    """While ``init_process_group`` runs: cut its sockets as soon as a member is recorded dead.

    A member that dies between saying *ready* and finishing gloo's rendezvous can leave the
    others' ``init_process_group`` waiting far beyond its timeout (measured with torch 2.13 and
    a 3 s timeout: 3 s, 15 s, and once over 100 s). The group is doomed then; shutting down the
    connections it is opening makes gloo raise instead of waiting on a dead peer.
    """

    def __init__(self, doomed: Callable[[], bool], before: dict[int, str]) -> None:
        self._doomed, self._before = doomed, before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-init-watch", daemon=True)

    def __enter__(self) -> InitWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                if self._doomed():
                    GroupSockets.opened_since(self._before).cut()
                    return
            except Exception as exc:  # the store went away: nothing left to watch
                log.warning("init watch stopped: %s", exc)
                return
