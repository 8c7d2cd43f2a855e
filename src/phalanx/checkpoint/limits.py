"""Bounds on what a checkpoint's files may claim, checked before anything is read or allocated.

A checkpoint directory is untrusted input: a crash, a copy or a crafted file may hold anything.
Every reader in :mod:`phalanx.checkpoint` goes through these checks, each O(metadata), never per
tensor byte, and each failure is a :class:`CheckpointError` naming the file:

- **Only regular files are opened.** :func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO or
  a device named ``latest`` or ``model.safetensors`` cannot block the open) and refuses
  anything ``fstat`` does not call a regular file, before reading a byte.
- **A JSON file is at most** :func:`max_json_bytes` **bytes** (64 MiB unless the environment
  variable ``PHALANX_CHECKPOINT_MAX_JSON_MB`` says otherwise), checked against its size on
  disk (or in the manifest) before it is read; ``save`` refuses to write a larger one. A
  safetensors header has its own cap of 100 MB (``format.py``, as the safetensors library).
- **JSON nests at most** :data:`MAX_DEPTH` **levels** (``save`` refuses deeper state), so no
  parser or decoder recurses without bound.
- **A tensor shape** has at most :data:`MAX_DIMS` dimensions, each a non-negative int64, whose
  product fits in int64 (:func:`shape_ok`).
- **Counts are bounded by the files**: ``world_size`` by the rank files the manifest lists
  (``manifest.py``), a sharded index by the bytes of the tensor files that hold its pieces
  (``sharded.py``), the manifest's entries by its size.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path
from typing import Any, TypeGuard

from phalanx.checkpoint.errors import CheckpointError

__all__ = [
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_JSON_ENV",
    "check_json_size",
    "deeper_than",
    "max_json_bytes",
    "open_regular",
    "parse_json",
    "read_json",
    "shape_ok",
]

MAX_JSON_ENV = "PHALANX_CHECKPOINT_MAX_JSON_MB"
_DEFAULT_JSON_MB = 64
MAX_DEPTH = 100
"""Most levels of nesting a checkpoint's JSON may have (an optimizer's state needs about 6)."""
MAX_DIMS = 64
"""Most dimensions a saved tensor may have."""
_INT64 = 2**63


def max_json_bytes() -> int:
    """The largest JSON file a checkpoint may hold: ``PHALANX_CHECKPOINT_MAX_JSON_MB`` MiB
    (default 64; raise it for samplers or ``extra`` dicts with huge lists)."""
    raw = os.environ.get(MAX_JSON_ENV, str(_DEFAULT_JSON_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0 < mb < 2**40:
        raise ValueError(f"{MAX_JSON_ENV}={raw!r} is not a positive number of MiB")
    return int(mb * 1024 * 1024)


def check_json_size(path: str | os.PathLike[str], size: int) -> None:
    """Refuse a JSON file of ``size`` bytes over :func:`max_json_bytes`, naming ``path``."""
    limit = max_json_bytes()
    if size > limit:
        raise CheckpointError(
            f"{path}: {size} bytes, over the {limit}-byte limit of a checkpoint JSON file; "
            f"refusing to read it (set {MAX_JSON_ENV} to raise the limit)"
        )


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "a device or socket"


def _refuse_unless_regular(path: str | os.PathLike[str], mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{os.fspath(path)}: is {_kind(mode)}, not a regular file; a checkpoint reads only "
            f"regular files (refusing to open it)"
        )


def open_regular(path: str | os.PathLike[str]) -> io.FileIO:
    """Open ``path`` for reading if it is a regular file, without ever blocking on the open.

    ``stat`` refuses the rest before the open (a socket cannot be opened at all), ``fstat`` after
    it (the path may have been replaced in between; ``O_NONBLOCK`` keeps a FIFO from blocking).

    Raises:
        FileNotFoundError: when it does not exist.
        CheckpointError: naming ``path`` when it is anything but a regular file.
    """
    _refuse_unless_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC)
    try:
        _refuse_unless_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "rb", closefd=True)


def deeper_than(doc: Any, limit: int) -> bool:
    """Whether ``doc`` (parsed JSON) nests lists and dicts more than ``limit`` levels deep."""
    stack = [(doc, 1)] if isinstance(doc, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_json(
    raw: bytes, where: Path | str, error: type[CheckpointError] = CheckpointError
) -> Any:
    """Parse JSON bytes from ``where``, refusing invalid JSON and nesting over MAX_DEPTH."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        doc = None
        deep = True
    except ValueError as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None
    else:  # fewer brackets than levels allowed cannot nest too deep: skip the walk
        deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and deeper_than(doc, MAX_DEPTH)
    if deep:
        raise error(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; refusing it")
    return doc


def read_json(path: Path) -> Any:
    """Parse the JSON file ``path``: a regular file of at most :func:`max_json_bytes`."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        check_json_size(path, size)
        raw = f.read(size)
    return parse_json(raw, path)


def shape_ok(shape: Any) -> TypeGuard[list[int]]:
    """Whether ``shape`` is a list of at most MAX_DIMS ints >= 0 whose product fits in int64
    (zeros count as ones: torch checks every partial product)."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        return False
    total = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < _INT64:
            return False
        total *= max(d, 1)
        if total >= _INT64:
            return False
    return True
