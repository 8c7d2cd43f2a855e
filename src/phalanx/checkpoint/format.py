"""The safetensors file format, written and read without copies and without unpickling.

A safetensors file is ``u64 little-endian header length | JSON header | raw tensor bytes``. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the end of the header) plus an optional ``"__metadata__"`` string map. Files written
here open with the ``safetensors`` library and vice versa; phalanx does not need the library.

Writing: :func:`encode` returns the header and one zero-copy ``memoryview`` per tensor, so the
writer can hash and write the bytes straight from the tensors' memory. Reading: :func:`decode`
validates every offset, dtype and shape in the header, then makes tensors that share the buffer
the file was read into (``torch.frombuffer``): one read, no copy. :func:`open_mapped` decodes a
memory map of the file instead, so a reader touching a slice of a tensor reads just its pages.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import sys
from typing import Any

import torch

from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.limits import MAX_DIMS, open_regular, parse_json, shape_ok

__all__ = ["FormatError", "decode", "encode", "open_mapped"]

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
) -> list[memoryview | bytes]:
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
    buffers: list[memoryview | bytes] = [b""]
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
        buffers.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    buffers[0] = len(raw).to_bytes(8, "little") + raw
    return buffers


def _header(data: Any, where: str) -> tuple[dict[str, object], int]:
    if len(data) < 8:
        raise FormatError(f"{where}: {len(data)} bytes is too short for a safetensors file")
    n = int.from_bytes(bytes(data[:8]), "little")
    if not 2 <= n <= min(_MAX_HEADER, len(data) - 8):
        raise FormatError(f"{where}: header length {n} does not fit the {len(data)}-byte file")
    header = parse_json(bytes(data[8 : 8 + n]), f"{where}: the header", FormatError)
    if not isinstance(header, dict):
        raise FormatError(f"{where}: the header is a {type(header).__name__}, not an object")
    return header, 8 + n


def _entry(
    where: str, name: str, info: object, size: int
) -> tuple[torch.dtype, list[int], int, int]:
    dtype_name = info.get("dtype") if isinstance(info, dict) else None
    if not isinstance(info, dict) or not isinstance(dtype_name, str) or dtype_name not in _BY_NAME:
        raise FormatError(f"{where}: tensor {name!r} has no valid dtype ({info!r:.200})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not shape_ok(shape):
        raise FormatError(
            f"{where}: tensor {name!r} has an invalid shape {shape!r:.200} (at most {MAX_DIMS} "
            f"dimensions, each an int >= 0, their product an int64)"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= size
    ):
        raise FormatError(
            f"{where}: tensor {name!r} has data_offsets {offsets!r:.200} outside the {size} "
            f"data bytes"
        )
    dtype = _BY_NAME[info["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(
            f"{where}: tensor {name!r} of shape {shape} and dtype {info['dtype']} "
            f"needs {nbytes} bytes, data_offsets {offsets} give "
            f"{offsets[1] - offsets[0]}"
        )
    return dtype, shape, offsets[0], offsets[1]


def decode(
    data: torch.Tensor | bytearray, where: str = "<buffer>"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file read into ``data`` (tensors share ``data``).

    Args:
        data: The whole file, as a 1-D uint8 CPU tensor or a bytearray. The tensors returned
            are views of it.
        where: The file name, for error messages.

    Raises:
        FormatError: naming ``where`` and the entry when the header is inconsistent.
    """
    buf: Any = data.numpy() if isinstance(data, torch.Tensor) else data
    header, start = _header(buf, where)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: __metadata__ is not an object")
    size = len(buf) - start
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype, shape, begin, end = _entry(where, name, info, size)
        spans.append((begin, end, name))
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=start + begin)
            tensors[name] = flat.reshape(shape)
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise FormatError(f"{where}: tensors {a!r} and {b!r} overlap")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def open_mapped(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of the safetensors file ``path`` as views of a private memory map of it.

    Pages are read when a tensor's elements are first touched. The map is copy-on-write, so
    the tensors are writable without ever changing the file.

    Raises:
        FormatError: naming the file and the entry when the header is inconsistent.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:  # mmap refuses an empty file; decode names the problem
            return decode(bytearray(f.read()), str(path))[0]
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # the tensor (and every view decode makes of it) holds a reference to the map
    return decode(torch.frombuffer(mapped, dtype=torch.uint8), str(path))[0]
