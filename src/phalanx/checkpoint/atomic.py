"""Crash-safe files and directories: fsync'd writes, atomic commit, the ``latest`` pointer.

A checkpoint is committed in this order (a crash at any point leaves the previous one in force):

1. data files are written into ``.tmp-step-000123-<token>/``, each fsync'd (crc32c as written);
2. ``manifest.json`` (the checksum of every file) is written and fsync'd, then the directory;
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

import logging
import os
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import crc32c

from phalanx.checkpoint.checksum import Digest, TensorBytes
from phalanx.checkpoint.limits import open_regular
from phalanx.checkpoint.manifest import FileEntry
from phalanx.checkpoint.writeback import Writeback

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
_CHUNK = 8 * 1024 * 1024  # checksummed while still in the CPU's cache
_COMBINE_FROM = 256 * 1024
"""Chunks from this size are checksummed once and combined (cheaper than a second pass)."""
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


Buffer = memoryview | bytes | TensorBytes
"""What a file is written from: raw bytes, or a tensor's bytes with its name."""


def _pieces(buffers: Sequence[Buffer]) -> list[tuple[str | None, memoryview]]:
    """``(tensor name or None, chunk)`` of at most _CHUNK bytes for every buffer, in order."""
    out: list[tuple[str | None, memoryview]] = []
    for buf in buffers:
        name, data = buf if isinstance(buf, TensorBytes) else (None, buf)
        view = memoryview(data).cast("B")
        out.extend((name, view[i : i + _CHUNK]) for i in range(0, view.nbytes, _CHUNK))
    return out


def _split_at(
    pieces: list[tuple[str | None, memoryview]], offset: int
) -> list[tuple[str | None, memoryview]]:
    """``pieces`` with the one spanning byte ``offset`` cut in two there (offset < 0: as is)."""
    start = 0
    for i, (name, piece) in enumerate(pieces):
        if start < offset < start + piece.nbytes:
            cut = offset - start
            return [*pieces[:i], (name, piece[:cut]), (name, piece[cut:]), *pieces[i + 1 :]]
        start += piece.nbytes
    return pieces


def write_file(path: Path, buffers: Sequence[Buffer], *, faulty: bool = False) -> FileEntry:
    """Create ``path`` with the concatenated ``buffers``, fsync it, and return its checksums.

    Each chunk is checksummed (crc32c of the file, and of its tensor for a
    :class:`~phalanx.checkpoint.checksum.TensorBytes`) right after it is written, while it is
    still in the CPU's cache: the file is never read back. A tensor's chunk is read once: its
    crc32c is combined into both digests (``Digest.extend``).

    Args:
        path: A new file (an existing one is an error).
        buffers: Bytes to write, in order; tensors' memoryviews are written without copies.
        faulty: Honour the ``mid-tensor-file`` fault point here.
    """
    pieces = _pieces(buffers)
    total = sum(p.nbytes for _, p in pieces)
    half = total // 2 if faulty and os.environ.get(FAULT_ENV) == "mid-tensor-file" else -1
    digest = Digest()
    tensors = {b.name: Digest() for b in buffers if isinstance(b, TensorBytes)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_pieces(fd, _split_at(pieces, half), digest, tensors, half)
    except OSError as exc:  # os.write's error (a full disk...) does not name the file
        exc.filename = exc.filename or str(path)
        raise
    finally:
        os.close(fd)
    crcs = {name: d.hexdigest() for name, d in tensors.items()} if tensors else None
    return FileEntry(digest.hexdigest(), total, tensors=crcs)


def _write_pieces(
    fd: int,
    pieces: list[tuple[str | None, memoryview]],
    digest: Digest,
    tensors: dict[str, Digest],
    half: int,
) -> None:
    """Write and checksum ``pieces``; fsync (and honour the fault point) at byte ``half``."""
    written = 0
    writeback = Writeback(fd)
    for name, piece in pieces:
        _write_all(fd, piece)
        writeback.wrote(piece.nbytes)
        if name is None:
            digest.update(piece)
        elif piece.nbytes < _COMBINE_FROM:
            digest.update(piece)
            tensors[name].update(piece)
        else:  # checksum the chunk once; add it to the tensor's digest and the file's
            crc = crc32c.crc32c(piece)
            digest.extend(crc, piece.nbytes)
            tensors[name].extend(crc, piece.nbytes)
        written += piece.nbytes
        if written == half:  # crash tests: half a tensor file is on disk
            os.fsync(fd)
            fault("mid-tensor-file")
    os.fsync(fd)


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
