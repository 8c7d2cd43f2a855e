"""Crash-safe files and directories: fsync'd writes, atomic commit, the ``latest`` pointer.

A checkpoint is committed in this order (a crash at any point leaves the previous one in force):

1. data files are written into ``.tmp-step-000123-<token>/``, each fsync'd (hashed as written);
2. ``manifest.json`` (the sha256 of every file) is written and fsync'd, then the directory;
3. the directory is renamed to ``step-000123`` (an existing one, of a re-saved step, is renamed
   aside first: ``catalog.py``) and the parent directory fsync'd;
4. ``latest`` is replaced atomically (temp file, fsync, ``os.replace``, fsync of the parent).

Loading trusts ``latest``; without a valid one it takes the newest ``step-*`` directory whose
manifest verifies. ``.tmp-*`` directories are never loaded.

Fault injection, for crash tests: with ``PHALANX_CHECKPOINT_FAULT`` set to one of
:data:`FAULT_POINTS` the writer SIGKILLs its own process at that point:
``mid-tensor-file`` (after half of the first tensor file written by rank 0, fsync'd),
``before-manifest``, ``before-rename``, ``between-renames`` (a re-save of a step: its old
directory renamed aside, the new one not yet in its place) and ``before-latest`` (after the
rename).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from phalanx.checkpoint.limits import open_regular
from phalanx.checkpoint.manifest import FileEntry

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "LATEST",
    "fault",
    "fsync_dir",
    "read_latest",
    "remove_tree",
    "step_name",
    "step_of",
    "write_file",
    "write_latest",
]

log = logging.getLogger(__name__)

FAULT_ENV = "PHALANX_CHECKPOINT_FAULT"
FAULT_POINTS = (
    "mid-tensor-file",
    "before-manifest",
    "before-rename",
    "between-renames",
    "before-latest",
)
LATEST = "latest"
_STEP = re.compile(r"step-(\d{6,})")
_CHUNK = 32 * 1024 * 1024
_MAX_LATEST = 256


def fault(point: str) -> None:
    """SIGKILL this process if ``PHALANX_CHECKPOINT_FAULT`` names ``point`` (crash tests)."""
    assert point in FAULT_POINTS, point
    if os.environ.get(FAULT_ENV) == point:
        log.warning("%s=%s: killing this process (fault injection)", FAULT_ENV, point)
        os.kill(os.getpid(), signal.SIGKILL)


def step_name(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (``step-000123``)."""
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step a ``step-NNNNNN`` directory name stands for, or None for other names."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _pieces(buffers: Sequence[memoryview | bytes]) -> list[memoryview]:
    out: list[memoryview] = []
    for buf in buffers:
        view = memoryview(buf).cast("B")
        out.extend(view[i : i + _CHUNK] for i in range(0, view.nbytes, _CHUNK))
    return out


def _split_at(pieces: list[memoryview], offset: int) -> list[memoryview]:
    """``pieces`` with the one spanning byte ``offset`` cut in two there (offset < 0: as is)."""
    start = 0
    for i, piece in enumerate(pieces):
        if start < offset < start + piece.nbytes:
            cut = offset - start
            return [*pieces[:i], piece[:cut], piece[cut:], *pieces[i + 1 :]]
        start += piece.nbytes
    return pieces


def write_file(
    path: Path, buffers: Sequence[memoryview | bytes], *, faulty: bool = False
) -> FileEntry:
    """Create ``path`` with the concatenated ``buffers``, fsync it, and return its sha256.

    The bytes are hashed from memory while a helper thread waits for the fsync (the disk works
    while the CPU hashes), so the file is never read back and hashing adds little time.

    Args:
        path: A new file (an existing one is an error).
        buffers: Bytes to write, in order; tensors' memoryviews are written without copies.
        faulty: Honour the ``mid-tensor-file`` fault point here.
    """
    pieces = _pieces(buffers)
    total = sum(p.nbytes for p in pieces)
    half = total // 2 if faulty and os.environ.get(FAULT_ENV) == "mid-tensor-file" else -1
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        written = 0
        for piece in _split_at(pieces, half):
            _write_all(fd, piece)
            written += piece.nbytes
            if written == half:  # crash tests: half a tensor file is on disk
                os.fsync(fd)
                fault("mid-tensor-file")
        with ThreadPoolExecutor(1, thread_name_prefix="phalanx-fsync") as pool:
            synced = pool.submit(os.fsync, fd)
            for piece in pieces:
                digest.update(piece)
            synced.result()
    finally:
        os.close(fd)
    return FileEntry(digest.hexdigest(), total)


def fsync_dir(path: Path) -> None:
    """fsync a directory, making the creation, renaming or removal of its entries durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(directory: Path, name: str, token: str) -> None:
    """Point ``directory/latest`` at checkpoint ``name`` atomically (temp file + os.replace)."""
    tmp = directory / f".{LATEST}.tmp-{token}"
    write_file(tmp, [f"{name}\n".encode()])
    os.replace(tmp, directory / LATEST)
    fsync_dir(directory)


def read_latest(directory: Path) -> str | None:
    """The checkpoint name ``directory/latest`` holds, or None (absent, a symlink, over 256
    bytes, or not a step name: each logged).

    Raises:
        CheckpointError: naming ``latest`` when it is a FIFO, device or directory (opened
            without blocking and refused, see :mod:`phalanx.checkpoint.limits`).
    """
    path = directory / LATEST
    if path.is_symlink():
        log.warning("%s is a symlink; ignoring it", path)
        return None
    try:
        with open_regular(path) as f:
            raw = f.read(_MAX_LATEST + 1)
    except FileNotFoundError:
        return None
    if len(raw) > _MAX_LATEST:
        log.warning("%s is over %d bytes, not a checkpoint name; ignoring it", path, _MAX_LATEST)
        return None
    name = raw.decode("ascii", errors="replace").strip()
    if step_of(name) is None:
        log.warning("%s holds %r, not a checkpoint name like step-000123; ignoring it", path, name)
        return None
    return name


def remove_tree(path: Path) -> None:
    """Delete a checkpoint, temporary directory or file (never following a symlink)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
