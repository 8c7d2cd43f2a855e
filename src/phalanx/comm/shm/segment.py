"""A POSIX shared-memory segment that every rank of a group maps and nobody leaves behind.

Rank 0 creates ``/dev/shm/phalanx-shm-<uid>-<random>`` (``O_EXCL``, mode 0600, its pages
reserved with ``posix_fallocate`` so that a full ``/dev/shm`` is an error here and not a SIGBUS
later), and publishes the name through the group's c10d store. Every rank maps it and says so
in the store; the last one to map it unlinks the name, and every rank waits for that before
the group is handed out. From then on the segment has no name: it lives as long as a rank maps
it, and a crash of any rank leaves nothing in ``/dev/shm``. The only window for a leak is rank
0 dying between creating the file and the others mapping it (milliseconds at start-up); even
then a surviving rank unlinks it when it gives up waiting.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from phalanx.comm.shm.sync import process_start

__all__ = [
    "HOST_ENV",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Meeting",
    "check_one_host",
    "host_identity",
    "meet",
    "open_segment",
]

SHM_DIR = "/dev/shm"
HOST_ENV = "PHALANX_SHM_HOST"
SEGMENT_PREFIX = "phalanx-shm-"
_KEY = "phalanx_shm/"


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def host_identity() -> str:
    """The machine this process runs on, as far as ``/dev/shm`` goes: ``PHALANX_SHM_HOST`` if
    set (to tell apart containers that repeat a hostname, or to split one machine in tests),
    else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def meet(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Meeting:
    """Every rank's host (:func:`host_identity`) and process, through the store."""
    pid = os.getpid()
    store.set(f"{_KEY}host/{rank}", f"{pid} {process_start(pid) or 0} {host_identity()}")
    keys = [f"{_KEY}host/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    fields = [store.get(k).decode().split(" ", 2) for k in keys]
    processes = [(int(f[0]), int(f[1])) for f in fields]
    visible = all(process_start(p) == start for p, start in processes)
    return Meeting([f[2] for f in fields], processes if visible else None)


@dataclass(frozen=True)
class Meeting:
    """Where the ranks of a group run."""

    hosts: list[str]
    """Each rank's host."""
    processes: list[tuple[int, int]] | None
    """Each rank's (pid, process start time); None when this process cannot see them all
    (another pid namespace): then a dead peer is found by the timeout only."""

    @property
    def one_host(self) -> bool:
        return len(set(self.hosts)) == 1


def check_one_host(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> list[tuple[int, int]] | None:
    """Raise when the ranks of the group are not all on this machine; else
    :attr:`Meeting.processes`."""
    met = meet(store, rank, world_size, timeout)
    if not met.one_host:
        where = ", ".join(f"rank {r} on {h}" for r, h in enumerate(met.hosts))
        raise ValueError(
            f"an shm segment needs every rank of the group on one machine, but {where}; "
            f"set {HOST_ENV} alike where one machine has several hostnames"
        )
    return met.processes


def _create(nbytes: int) -> tuple[str, int]:
    name = f"{SEGMENT_PREFIX}{os.getuid()}-{secrets.token_hex(8)}"
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(_path(name))
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise RuntimeError(
                f"backend='shm' could not reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR} "
                f"({os.strerror(exc.errno)}): enlarge {SHM_DIR} (docker run --shm-size) or "
                "lower PHALANX_SHM_SLOT_MB"
            ) from exc
        raise
    return name, fd


def _attach(store: dist.Store, timeout: timedelta) -> tuple[str, int]:
    store.wait([f"{_KEY}name"], timeout)
    name = store.get(f"{_KEY}name").decode()
    try:
        return name, os.open(_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(
            f"backend='shm': rank 0's segment {_path(name)} is not visible here: the ranks do "
            f"not share {SHM_DIR} (separate containers or machines); use backend='gloo'"
        ) from None


def open_segment(
    store: dist.Store, rank: int, world_size: int, nbytes: int, timeout: timedelta
) -> tuple[str, mmap.mmap]:
    """Create (rank 0) or attach to the group's segment: its path (already unlinked) and map."""
    if rank == 0:
        name, fd = _create(nbytes)
        store.set(f"{_KEY}name", name)
    else:
        name, fd = _attach(store, timeout)
    try:
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    store.set(f"{_KEY}mapped/{rank}", "1")
    if store.add(f"{_KEY}mapped", 1) == world_size:
        _unlink(name)
        store.set(f"{_KEY}unlinked", "1")
    try:
        store.wait([f"{_KEY}unlinked"], timeout)
    except dist.DistStoreError as exc:
        _unlink(name)
        mapped.close()
        missing = [r for r in range(world_size) if not store.check([f"{_KEY}mapped/{r}"])]
        raise TimeoutError(
            f"backend='shm': ranks {missing} did not map the group's shared segment within "
            f"{timeout.total_seconds():g} s; start every rank, or check that they run"
        ) from exc
    return _path(name), mapped


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))
