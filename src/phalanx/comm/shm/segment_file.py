"""The file behind a group's segment: made by the creator, opened by the peers, checked by both.

Where the creator can see its peers' processes, the segment is a ``memfd`` (``memfd_create``):
it has no name in ``/dev/shm`` at any moment, so no crash of any rank can leave it behind. A
peer opens it through ``/proc/<creator pid>/fd/<fd>`` (the kernel lets a process of the same
user open another's descriptors there; ``pidfd_getfd`` would need ptrace rights, which Yama
often withholds). Where it cannot see them (another pid namespace), the segment is a file
``/dev/shm/phalanx-shm-<uid>-<16 hex>``, unlinked by its creator once every rank has mapped it.

Nothing a peer opens is taken on trust. The descriptor (:class:`Handle`) comes signed from the
creator (``segment.py``), and before and after the ``open``:

- a name must be exactly phalanx's own form, with this process's uid (:func:`check_name`);
- a ``/dev/shm`` file is opened with ``O_NOFOLLOW`` (a symlink does not redirect it), and a
  ``/proc`` descriptor only if it links to ``/memfd:<that name>``;
- every open is ``O_NONBLOCK`` (a FIFO slipped in cannot block), and the file opened must be
  a regular file of this uid, mode 0600, of the expected size, and the very inode the creator
  signed (``st_dev``, ``st_ino``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from dataclasses import dataclass

__all__ = [
    "MEMFD",
    "NAMED",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Handle",
    "SegmentError",
    "check_name",
    "close_created",
    "create",
    "open_handle",
    "shm_path",
]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "phalanx-shm-"
MEMFD = "memfd"
NAMED = "file"
_NAME = re.compile(rf"{re.escape(SEGMENT_PREFIX)}(\d+)-[0-9a-f]{{16}}")
_OPEN = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK


class SegmentError(RuntimeError):
    """A segment descriptor or file that is not the creator's: refused before any use."""


@dataclass(frozen=True)
class Handle:
    """How a peer finds the creator's segment (signed by the creator, ``segment.py``)."""

    kind: str
    """:data:`MEMFD` or :data:`NAMED`."""
    name: str
    """``phalanx-shm-<uid>-<16 hex>``: the memfd's label, or the file's name in ``/dev/shm``."""
    pid: int
    """The creator's pid (memfd: whose descriptor table holds it)."""
    fd: int
    """The creator's descriptor of the segment."""
    dev: int
    ino: int
    """The file's identity, as the creator's ``fstat`` saw it."""
    nbytes: int


def shm_path(name: str) -> str:
    """Where a segment named ``name`` is (or would be) in ``/dev/shm``."""
    return os.path.join(SHM_DIR, name)


def _new_name() -> str:
    return f"{SEGMENT_PREFIX}{os.getuid()}-{secrets.token_hex(8)}"


def check_name(name: object) -> str:
    """``name`` if it is exactly phalanx's form with this process's uid; else raise."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or int(m.group(1)) != os.getuid():
        raise SegmentError(
            f"segment name {name!r} is not phalanx's own ({SEGMENT_PREFIX}{os.getuid()}-<16 hex "
            "digits>): refused before any open or unlink"
        )
    return str(name)


def _reserve(fd: int, nbytes: int, memfd: bool) -> None:
    """Give the file its pages now, so a shortage is an error here, not a SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            fix = (
                "free memory (or raise the container's memory limit)"
                if memfd
                else f"enlarge {SHM_DIR} (docker run --shm-size)"
            )
            raise SegmentError(
                f"backend='shm' could not reserve {nbytes / 2**20:.1f} MiB of shared memory "
                f"({os.strerror(exc.errno)}): {fix}, or lower PHALANX_SHM_SLOT_MB"
            ) from exc
        raise


def create(nbytes: int, memfd: bool) -> Handle:
    """Make a segment of ``nbytes`` (a memfd, else a named file in ``/dev/shm``)."""
    name = _new_name()
    if memfd:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.fchmod(fd, 0o600)
    else:
        fd = os.open(shm_path(name), _OPEN | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        _reserve(fd, nbytes, memfd)
        st = os.fstat(fd)
    except BaseException:
        close_created(Handle(NAMED if not memfd else MEMFD, name, os.getpid(), fd, 0, 0, nbytes))
        raise
    return Handle(MEMFD if memfd else NAMED, name, os.getpid(), fd, st.st_dev, st.st_ino, nbytes)


def close_created(handle: Handle) -> None:
    """The creator's side, once every rank mapped it (or gave up): unlink the name, close."""
    if handle.kind == NAMED:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(check_name(handle.name)))
    with contextlib.suppress(OSError):
        os.close(handle.fd)


def _open_memfd(handle: Handle) -> int:
    link = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        target = os.readlink(link)
        if target != f"/memfd:{handle.name} (deleted)":
            raise SegmentError(f"{link} is {target!r}, not the memfd {handle.name!r}: refused")
        return os.open(link, _OPEN)
    except (FileNotFoundError, PermissionError) as exc:
        raise SegmentError(
            f"backend='shm': cannot open rank 0's segment at {link} ({exc.strerror}): the ranks "
            "must run as one user and see each other's processes; use backend='gloo'"
        ) from None


def _open_named(handle: Handle) -> int:
    path = shm_path(handle.name)
    try:
        return os.open(path, _OPEN | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SegmentError(
            f"backend='shm': rank 0's segment {path} is not visible here: the ranks do not "
            f"share {SHM_DIR} (separate containers or machines); use backend='gloo'"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentError(f"{path} is a symbolic link, not rank 0's segment") from None
        raise


def _check_file(fd: int, handle: Handle) -> None:
    st = os.fstat(fd)
    wrong = []
    if not stat.S_ISREG(st.st_mode):
        wrong.append("not a regular file")
    if st.st_uid != os.getuid():
        wrong.append(f"owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        wrong.append(f"mode {stat.S_IMODE(st.st_mode):o}, not 600")
    if st.st_size != handle.nbytes:
        wrong.append(f"{st.st_size} bytes, not {handle.nbytes}")
    if (st.st_dev, st.st_ino) != (handle.dev, handle.ino):
        wrong.append("another inode than the one rank 0 made")
    if wrong:
        raise SegmentError(f"segment {handle.name!r} refused: {'; '.join(wrong)}")


def open_handle(handle: Handle) -> int:
    """A peer's descriptor of the creator's segment, checked (see the module docstring)."""
    check_name(handle.name)
    if handle.kind not in (MEMFD, NAMED) or handle.pid <= 0 or handle.fd < 0:
        raise SegmentError(f"segment descriptor {handle!r} is malformed: refused")
    fd = _open_memfd(handle) if handle.kind == MEMFD else _open_named(handle)
    try:
        _check_file(fd, handle)
    except BaseException:
        os.close(fd)
        raise
    return fd
