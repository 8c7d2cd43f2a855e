"""The manifest of a checkpoint: what it holds, and a checksum for every file it consists of.

``manifest.json`` is written after all data files; a checkpoint directory without one is
incomplete. Every file the loader opens must be listed in it, and is checked against it while
it is read (:func:`read_verified`, ``format.read_tensors``): size first (a truncated file fails
at once), then the checksum (``checksum.py``: crc32c, or sha256 in checkpoints written before)
over the same bytes that are then decoded, so each byte is read once. File names in a manifest
are confined to the checkpoint directory: absolute paths, ``..`` and symlinks that resolve
outside it are rejected, naming the entry. ``world_size`` is bounded by the rank files listed
(every rank writes ``rank-NNNNN.json``), and the manifest's size by ``limits.max_json_bytes``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from phalanx.checkpoint.checksum import DEFAULT, Digest, is_digest
from phalanx.checkpoint.errors import CheckpointError, ChecksumError
from phalanx.checkpoint.limits import open_regular, read_json

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "ChecksumError",
    "FileEntry",
    "Manifest",
    "check_size",
    "file_digest",
    "mismatch",
    "read_manifest",
    "read_verified",
    "safe_path",
    "verify_files",
]

FORMAT = "phalanx-checkpoint/2"
_READABLE = (FORMAT, "phalanx-checkpoint/1")  # /1: sha256 digests only
MANIFEST = "manifest.json"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_READ_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """Size and checksum of one file of a checkpoint (plus one crc32c per tensor, if any)."""

    digest: str
    """Hex digest of the whole file."""
    bytes: int
    algo: str = DEFAULT
    """Its checksum: ``"crc32c"``, or ``"sha256"`` in checkpoints written before."""
    tensors: dict[str, str] | None = None
    """Tensor name -> crc32c (hex) of its bytes, for a tensor file; names a corrupt tensor."""

    def to_json(self) -> dict[str, Any]:
        """``{"bytes": n, "<algo>": digest}`` (plus ``"tensors"``), as a manifest records it."""
        doc: dict[str, Any] = {"bytes": self.bytes, self.algo: self.digest}
        if self.tensors is not None:
            doc["tensors"] = self.tensors
        return doc

    @classmethod
    def from_json(cls, info: Any) -> FileEntry | None:
        """The entry ``info`` records, or None when it is malformed."""
        if not isinstance(info, dict):
            return None
        algo = DEFAULT if DEFAULT in info else "sha256"
        size, tensors = info.get("bytes"), info.get("tensors")
        if not is_digest(algo, info.get(algo)) or not isinstance(size, int) or size < 0:
            return None
        if tensors is not None and not (
            isinstance(tensors, dict) and all(is_digest(DEFAULT, d) for d in tensors.values())
        ):
            return None
        return cls(info[algo], size, algo, tensors)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records about one checkpoint."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    sections: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The manifest as indented JSON bytes."""
        doc = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "sections": self.sections,
            "extra": self.extra,
            "files": {k: v.to_json() for k, v in self.files.items()},
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    def entry(self, ckpt: Path, name: str) -> FileEntry:
        """The manifest entry of ``name``; a file absent from the manifest is an error."""
        if name not in self.files:
            raise CheckpointError(
                f"{ckpt / name}: not listed in {ckpt / MANIFEST}; the "
                f"checkpoint is incomplete or was edited"
            )
        return self.files[name]


def safe_path(ckpt: Path, name: str) -> Path:
    """``ckpt / name``, refusing names that could reach outside the checkpoint directory.

    Raises:
        CheckpointError: naming the entry when it is absolute, contains ``..`` or a separator,
            or is a symlink resolving outside ``ckpt``.
    """
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or len(pure.parts) != 1 or "\\" in name:
        raise CheckpointError(
            f"{ckpt / MANIFEST}: entry {name!r} is not a plain file name "
            f"inside the checkpoint directory; refusing to read it"
        )
    if not _NAME.fullmatch(name):
        raise CheckpointError(
            f"{ckpt / MANIFEST}: entry {name!r} has characters outside "
            f"[A-Za-z0-9_.-]; refusing to read it"
        )
    path = ckpt / name
    if os.path.realpath(path).rpartition(os.sep)[0] != os.path.realpath(ckpt):
        raise CheckpointError(
            f"{ckpt / MANIFEST}: entry {name!r} is a symlink pointing outside "
            f"the checkpoint directory ({os.path.realpath(path)}); refusing"
        )
    return path


def _field(doc: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool):
        raise CheckpointError(
            f"{where}: field {key!r} should be a {kind.__name__}, found {value!r:.80}"
        )
    return value


def _files(doc: dict[str, Any], ckpt: Path, where: Path) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    for name, info in _field(doc, "files", dict, where).items():
        safe_path(ckpt, name)
        entry = FileEntry.from_json(info)
        if entry is None:
            raise CheckpointError(
                f"{where}: entry {name!r} has no valid crc32c or sha256 and bytes ({info!r:.200})"
            )
        files[name] = entry
    return files


def _world_size(doc: dict[str, Any], files: dict[str, FileEntry], where: Path) -> int:
    """``world_size``, which must not exceed the rank files listed (each rank writes one)."""
    size = _field(doc, "world_size", int, where)
    if not 1 <= size <= len(files) or any(f"rank-{r:05d}.json" not in files for r in range(size)):
        raise CheckpointError(
            f"{where}: world_size {str(size)[:20]} does not match its files (one "
            f"rank-NNNNN.json per rank, {len(files)} files listed); the manifest is corrupt "
            f"or crafted"
        )
    return size


def read_manifest(ckpt: Path) -> Manifest:
    """Parse and validate ``ckpt/manifest.json`` (paths confined, fields typed, sizes bounded)."""
    where = ckpt / MANIFEST
    if where.is_symlink() or not where.exists():
        raise CheckpointError(f"{where}: missing; {ckpt} is not a complete checkpoint")
    doc = read_json(where)
    if not isinstance(doc, dict) or doc.get("format") not in _READABLE:
        found = doc.get("format") if isinstance(doc, dict) else doc
        raise CheckpointError(f"{where}: format is {found!r:.60}, expected {FORMAT!r}")
    step = _field(doc, "step", int, where)
    if not 0 <= step < 2**63:
        raise CheckpointError(f"{where}: step {str(step)[:20]} is not an int64 >= 0")
    files = _files(doc, ckpt, where)
    return Manifest(
        step=step,
        world_size=_world_size(doc, files, where),
        files=files,
        sections=[str(s) for s in _field(doc, "sections", list, where)],
        extra=_field(doc, "extra", dict, where),
    )


def mismatch(path: Path, entry: FileEntry, digest: str) -> ChecksumError | None:
    """The error to raise when ``path``'s ``digest`` is not the one ``entry`` records."""
    if digest == entry.digest:
        return None
    return ChecksumError(
        f"{path}: {entry.algo} is {digest}, the manifest records {entry.digest}; the file is "
        f"corrupt (use an older checkpoint with load(path=...))"
    )


def check_size(path: Path, entry: FileEntry, size: int) -> None:
    """Refuse ``path`` when its ``size`` on disk is not the one ``entry`` records."""
    if size != entry.bytes:
        raise ChecksumError(
            f"{path}: {size} bytes on disk, the manifest records {entry.bytes}; the file "
            f"is truncated or corrupt"
        )


def read_verified(ckpt: Path, manifest: Manifest, name: str) -> torch.Tensor:
    """Read ``ckpt/name`` whole (as a uint8 tensor), checking size and checksum on the way.

    Raises:
        ChecksumError: naming the file and both digests (or sizes) on a mismatch.
    """
    entry = manifest.entry(ckpt, name)
    path = safe_path(ckpt, name)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        check_size(path, entry, size)
        data = torch.empty(size, dtype=torch.uint8)  # not zero-filled: every byte is read
        array: Any = data.numpy()
        digest = Digest(entry.algo)
        view = memoryview(array)
        for start in range(0, size, _READ_CHUNK):
            chunk = view[start : start + _READ_CHUNK]
            _read_into(f, chunk, path)
            digest.update(chunk)
    if (error := mismatch(path, entry, digest.hexdigest())) is not None:
        raise error
    return data


def stream_digest(fd: int, algo: str) -> tuple[int, str]:
    """Size and ``algo`` digest of the open file ``fd``, read from its start in large
    sequential reads into one reused buffer (which also pulls a cold file into the page cache
    far faster than page faults on a memory map do)."""
    digest = Digest(algo)
    buffer = memoryview(bytearray(_READ_CHUNK))
    size = 0
    while n := os.preadv(fd, [buffer], size):
        digest.update(buffer[:n])
        size += n
    return size, digest.hexdigest()


def file_digest(path: Path, algo: str) -> tuple[int, str]:
    """Size and ``algo`` digest of the file ``path``, streaming (a regular file only)."""
    with open_regular(path) as f:
        return stream_digest(f.fileno(), algo)


def verify_files(ckpt: Path, manifest: Manifest) -> None:
    """Check every file of the manifest (size and checksum), streaming; raise on the first bad."""
    for name, entry in manifest.files.items():
        path = safe_path(ckpt, name)
        try:
            size, digest = file_digest(path, entry.algo)
        except FileNotFoundError:
            raise ChecksumError(f"{path}: listed in the manifest but missing") from None
        if size != entry.bytes or digest != entry.digest:
            raise ChecksumError(
                f"{path}: {size} bytes with {entry.algo} {digest}, the "
                f"manifest records {entry.bytes} bytes with {entry.digest}"
            )


def _read_into(f: Any, chunk: memoryview, path: Path) -> None:
    done = 0
    while done < len(chunk):
        n = f.readinto(chunk[done:])
        if not n:
            raise ChecksumError(f"{path}: ended early while reading; the file is truncated")
        done += n
