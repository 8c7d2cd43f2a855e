"""The safetensors files of a checkpoint: written from the tensors' memory, read by the library.

A safetensors file is ``u64 little-endian header length | JSON header | raw tensor bytes``. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the end of the header) plus an optional ``"__metadata__"`` string map.

Writing: :func:`encode` returns the header and one zero-copy ``memoryview`` per tensor, which
``atomic.write_file`` writes and checksums straight from the tensors' memory (measured faster
than ``safetensors.torch.save_file``, which would also need a second pass to checksum).

Reading: :func:`read_tensors` has the ``safetensors`` library map the file (zero-copy,
copy-on-write tensors) and checks the mapped bytes against the manifest's checksum in one pass.
Before the library sees the file, its header is checked within fixed bounds (a regular file,
at most 100 MB of JSON nested at most ``MAX_DEPTH`` deep, dtypes known, shapes within
``limits.shape_ok``); every error, the library's included, is a :class:`FormatError` or a
:class:`ChecksumError` naming the file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from phalanx.checkpoint.checksum import Digest, TensorBytes
from phalanx.checkpoint.errors import CheckpointError, ChecksumError
from phalanx.checkpoint.limits import MAX_DIMS, open_regular, parse_json, shape_ok
from phalanx.checkpoint.manifest import FileEntry, check_size, mismatch, stream_digest

__all__ = ["FormatError", "encode", "read_tensors"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class FormatError(CheckpointError, ValueError):
    """A safetensors file is malformed (its message names the file and the entry)."""


def _as_bytes(name: str, t: torch.Tensor) -> memoryview:
    """The tensor's bytes, in row-major order, without a copy when it is CPU and contiguous."""
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise TypeError(
            f"tensor {name!r} has layout {t.layout} and cannot be saved; "
            f"convert it to a dense tensor (.to_dense()) first"
        )
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def encode(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> list[bytes | TensorBytes]:
    """Header plus tensor bytes of a safetensors file holding ``tensors``, as buffers to write.

    Tensors are laid out by decreasing element size (then name), and the header is padded to a
    multiple of 8 bytes, so every tensor starts aligned to its element size.

    Raises:
        TypeError: naming the tensor whose dtype or layout safetensors cannot store.
    """
    if sys.byteorder != "little":
        raise RuntimeError("phalanx checkpoints need a little-endian machine")
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot "
                f"store; cast it to one of {sorted(_BY_NAME)}"
            )
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    buffers: list[bytes | TensorBytes] = [b""]
    offset = 0
    for name in order:
        data = _as_bytes(name, tensors[name])
        shape = list(tensors[name].shape)
        header[name] = {
            "dtype": _DTYPES[tensors[name].dtype],
            "shape": shape,
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        buffers.append(TensorBytes(name, data))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    buffers[0] = len(raw).to_bytes(8, "little") + raw
    return buffers


def _read_exact(f: Any, offset: int, n: int, where: str) -> bytes:
    raw = os.pread(f.fileno(), n, offset)
    if len(raw) != n:
        raise FormatError(f"{where}: ended early while reading its header")
    return raw


def _header(f: Any, size: int, where: str) -> tuple[bytes, dict[str, Any]]:
    """The raw header (length prefix included) and its tensor entries, checked within bounds."""
    if size < 8:
        raise FormatError(f"{where}: {size} bytes is too short for a safetensors file")
    n = int.from_bytes(_read_exact(f, 0, 8, where), "little")
    if not 2 <= n <= min(_MAX_HEADER, size - 8):
        raise FormatError(f"{where}: header length {n} does not fit the {size}-byte file")
    raw = _read_exact(f, 8, n, where)
    header = parse_json(raw, f"{where}: the header", FormatError)
    if not isinstance(header, dict):
        raise FormatError(f"{where}: the header is a {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _entry(where, name, info)
    return n.to_bytes(8, "little") + raw, header


def _entry(where: str, name: str, info: object) -> None:
    """Refuse what the library or torch would fail on badly: unknown dtypes, huge shapes."""
    dtype_name = info.get("dtype") if isinstance(info, dict) else None
    if not isinstance(info, dict) or not isinstance(dtype_name, str) or dtype_name not in _BY_NAME:
        raise FormatError(f"{where}: tensor {name!r:.80} has no valid dtype ({info!r:.200})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not shape_ok(shape):
        raise FormatError(
            f"{where}: tensor {name!r:.80} has an invalid shape {shape!r:.200} (at most "
            f"{MAX_DIMS} dimensions, each an int >= 0, their product an int64)"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise FormatError(f"{where}: tensor {name!r:.80} has data_offsets {offsets!r:.200}")


def _library_load(f: Any, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the open file ``f`` (``path``), mapped by the safetensors library.

    The library opens ``/proc/self/fd/N``, the very file checked to be regular, where there is
    one (elsewhere ``path`` itself).
    """
    proc = f"/proc/self/fd/{f.fileno()}"
    try:
        return load_file(proc if os.path.exists(proc) else os.fspath(path))
    except Exception as exc:  # SafetensorError, or torch refusing what the header claims
        raise FormatError(
            f"{path}: not a valid safetensors file ({type(exc).__name__}: {str(exc)[:300]})"
        ) from None


def _as_bytes_read(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy()


def _corrupt_tensors(
    tensors: dict[str, torch.Tensor], entry: FileEntry, order: list[str]
) -> list[str]:
    """The tensors whose bytes differ from the crc32c ``entry`` records for them."""
    bad = []
    for name in order:
        digest = Digest()
        if tensors[name].numel():
            digest.update(_as_bytes_read(tensors[name]))
        if entry.tensors is None or entry.tensors.get(name) != digest.hexdigest():
            bad.append(name)
    return bad


def _raise_mismatch(
    path: Path, entry: FileEntry, digest: str, tensors: dict[str, torch.Tensor], order: list[str]
) -> None:
    """Raise if ``digest`` (of the file as read) differs from ``entry``, naming the corrupt
    tensors where the entry lists a crc32c per tensor."""
    error = mismatch(path, entry, digest)
    if error is None:
        return
    if entry.tensors is not None:
        bad = _corrupt_tensors(tensors, entry, order)
        where = f"tensor(s) {', '.join(bad[:10])}" if bad else "its header"
        raise ChecksumError(f"{error} (corrupt: {where})") from None
    raise error


def _cached(fd: int, size: int) -> bool:
    """Whether the file seems to be in the page cache (its first, middle and last bytes are:
    a read with ``RWF_NOWAIT`` fails rather than wait for the disk). Where that flag does not
    exist, True."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None or size == 0:
        return True
    probe = bytearray(1)
    try:
        return all(os.preadv(fd, [probe], at, nowait) == 1 for at in (0, size // 2, size - 1))
    except (BlockingIOError, OSError):
        return False


def _mapped_digest(
    raw: bytes, tensors: dict[str, torch.Tensor], order: list[str], algo: str
) -> str:
    """The checksum of the file from its header and its mapped tensors, in file order."""
    digest = Digest(algo)
    digest.update(raw)
    for name in order:
        if tensors[name].numel():
            digest.update(_as_bytes_read(tensors[name]))
    return digest.hexdigest()


def read_tensors(path: Path, entry: FileEntry) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, verified against its manifest ``entry``.

    The library maps the file: the tensors are copy-on-write views of the map, writable without
    ever changing the file. The file is checksummed in one pass, where it is fastest: a file in
    the page cache as mapped (no copy); a cold one as it is read, in large sequential reads
    (``stream_digest``), which also bring it into the page cache at disk speed rather than a
    page fault at a time (a cold 1 GB load 1.39 s -> 0.99 s on the box of docs/checkpoints.md).

    Raises:
        ChecksumError: naming the file (and the corrupt tensors, when the entry lists crc32c
            per tensor) when its size or checksum differs from ``entry``.
        FormatError: naming the file when it is not a valid safetensors file (but matches its
            checksum: a crafted file rather than a corrupt one).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        check_size(path, entry, size)
        streamed = None if _cached(f.fileno(), size) else stream_digest(f.fileno(), entry.algo)
        try:
            raw, header = _header(f, size, str(path))
            tensors = _library_load(f, path)
        except FormatError:
            _, digest = streamed or stream_digest(f.fileno(), entry.algo)
            if (error := mismatch(path, entry, digest)) is not None:
                raise error from None  # corrupt, rather than crafted
            raise
    if tensors.keys() != header.keys():  # the file changed under us
        raise FormatError(f"{path}: its tensors changed while it was read")
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    if streamed is not None:
        digest = streamed[1]
    else:
        digest = _mapped_digest(raw, tensors, order, entry.algo)
    _raise_mismatch(path, entry, digest, tensors, order)
    return tensors
