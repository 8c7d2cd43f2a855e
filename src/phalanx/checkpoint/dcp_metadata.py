"""Reading torch DCP's pickled ``.metadata`` without letting it run code, and bounding it.

torch's ``FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``: a crafted file
runs whatever its ``__reduce__`` names, and even a file that names only DCP's own classes can
``setattr`` on them (``BUILD``) or expand shared references into 2**40 values.
:func:`~phalanx.checkpoint.dcp_pickle.loads_metadata` builds the metadata as data instead: only
DCP's record classes with checked field types, no ``__setstate__``, no call but its own, bounded
depth and expanded size (see :mod:`phalanx.checkpoint.dcp_pickle`).

The :class:`~torch.distributed.checkpoint.metadata.Metadata` built is then checked as
:mod:`phalanx.checkpoint.limits` checks phalanx's own files, before anything is allocated: the
file itself regular and at most :func:`~phalanx.checkpoint.limits.max_json_bytes`; every shape
within :func:`~phalanx.checkpoint.limits.shape_ok`; every object path at most
:data:`~phalanx.checkpoint.limits.MAX_DEPTH` long; every data file a plain name in the same
directory that is a regular file holding the byte range the metadata gives it; and all tensors
together no larger than the data files (so a crafted size cannot make the loader allocate more
than the files hold). Every refusal is a short :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from phalanx._check import shown
from phalanx.checkpoint.dcp_pickle import loads_metadata
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.limits import MAX_DEPTH, check_json_size, open_regular, shape_ok

__all__ = ["METADATA", "read_metadata"]

METADATA = ".metadata"
"""DCP's metadata file in a checkpoint directory."""


def _unpickle(path: Path) -> md.Metadata:
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        check_json_size(path, size)  # the same cap as a phalanx JSON file
        raw = f.read(size)
    return loads_metadata(raw, str(path))


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the file is corrupt or crafted, refusing it")


def _tensor_bytes(fqn: str, entry: Any, path: Path) -> int:
    """Bytes of a tensor entry, after checking its shape, dtype and chunks."""
    shape = list(entry.size) if isinstance(entry.size, torch.Size) else None
    dtype = getattr(entry.properties, "dtype", None)
    if not shape_ok(shape) or not isinstance(dtype, torch.dtype):
        raise _bad(path, f"entry {shown(fqn)} has shape {shown(entry.size)} and dtype {dtype!r}")
    chunks = entry.chunks
    if not isinstance(chunks, list) or not all(
        isinstance(c, md.ChunkStorageMetadata)
        and shape_ok(list(c.sizes))
        and shape_ok(list(c.offsets))
        and len(c.sizes) == len(c.offsets) == len(shape)
        for c in chunks
    ):
        raise _bad(path, f"entry {shown(fqn)} has malformed chunks")
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize


def _check_entries(meta: md.Metadata, path: Path) -> int:
    """Check ``state_dict_metadata`` and ``planner_data``; return the tensors' total bytes."""
    entries = meta.state_dict_metadata
    if not isinstance(entries, dict):
        raise _bad(path, "state_dict_metadata is not a dict")
    total = 0
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise _bad(path, f"key {shown(fqn)} is not a string")
        if isinstance(entry, md.TensorStorageMetadata):
            total += _tensor_bytes(fqn, entry, path)
        elif not isinstance(entry, md.BytesStorageMetadata):
            raise _bad(path, f"entry {shown(fqn)} is a {type(entry).__name__}")
    mapping = meta.planner_data
    if not isinstance(mapping, dict) or mapping.keys() != entries.keys():
        raise _bad(path, "planner_data does not map every entry to its path")
    # A list index is below the number of entries (each element of a saved list is one), so
    # rebuilding the lists cannot allocate more than the entries hold.
    count = len(entries)
    for fqn, where in mapping.items():
        if not (
            isinstance(where, tuple)
            and 0 < len(where) <= MAX_DEPTH
            and isinstance(where[0], str)
            and all(isinstance(k, str) or (type(k) is int and 0 <= k < count) for k in where[1:])
        ):
            raise _bad(
                path,
                f"the path of {shown(fqn)} is not a tuple of 1..{MAX_DEPTH} keys (names, or list "
                f"indices below {count})",
            )
    return total


def _data_size(path: Path, name: str) -> int:
    """The size of the data file ``name`` beside ``path``: a regular file (not a FIFO, a device
    or a directory) that exists."""
    try:
        with open_regular(path.parent / name) as f:
            return os.fstat(f.fileno()).st_size
    except OSError as exc:
        reason = f"its data file {path.parent / name} cannot be read ({exc.strerror})"
        raise _bad(path, reason) from None


def _check_storage(meta: md.Metadata, path: Path) -> int:
    """Check ``storage_data`` (plain regular files of this directory, ranges inside them);
    return the data files' total bytes."""
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise _bad(path, "storage_data is not a dict")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, md.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _bad(path, f"storage entry {shown(index)} is malformed")
        name = info.relative_path
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise _bad(path, f"data file {shown(name)} is not a plain file name of its directory")
        if info.transform_descriptors:
            raise _bad(path, f"{name}: transformed (e.g. compressed) data is not supported")
        if name not in sizes:
            sizes[name] = _data_size(path, name)
        offset, length = info.offset, info.length
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)) or (
            offset < 0 or length < 0 or offset + length > sizes[name]
        ):
            raise _bad(path, f"bytes {offset}+{length} of {name} ({sizes[name]} bytes)")
    return sum(sizes.values())


def read_metadata(directory: Path) -> md.Metadata:
    """The checked metadata of the DCP checkpoint in ``directory``.

    Raises:
        CheckpointError: naming the file, for a missing, oversized, non-regular, crafted or
            inconsistent metadata file (nothing in it runs).
    """
    path = directory / METADATA
    if not path.exists():
        raise CheckpointError(f"{path}: no such file; {directory} is not a DCP checkpoint")
    meta = _unpickle(path)
    tensors = _check_entries(meta, path)
    data = _check_storage(meta, path)
    if tensors > data:
        raise _bad(path, f"its tensors claim {tensors} bytes, its data files hold {data}")
    return meta
