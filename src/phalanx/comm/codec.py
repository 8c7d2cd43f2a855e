"""A pickle-free encoding for the object collectives: JSON with tagged containers and tensors.

torch's ``*_object`` collectives unpickle whatever a peer sends, which lets anyone who can reach
the job run code in it. phalanx's encode plain data (None, bool, int, float, str, bytes, list,
tuple, set, dict) and tensors, and refuses anything else by name. Decoding never executes code.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

__all__ = ["decode", "encode"]

_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "data": base64.b64encode(raw).decode(),
    }


def _untensor(d: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[d["dtype"]]
    raw = bytearray(base64.b64decode(d["data"]))
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(d["shape"]).clone()


def _enc(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return {"T": _tensor(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, list):
        return {"l": [_enc(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_enc(v) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"s": [_enc(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"d": {k: _enc(v) for k, v in obj.items()}}
        return {"m": [[_enc(k), _enc(v)] for k, v in obj.items()]}
    raise TypeError(
        f"cannot send an object of type {type(obj).__qualname__} through phalanx's object "
        f"collectives: they carry None, bool, int, float, str, bytes, list, tuple, set, dict and "
        f"tensors, never pickles. Convert it (e.g. to a dict), or use torch.distributed's "
        f"pickle-based variant if every peer is trusted."
    )


def _dec(obj: Any) -> Any:
    if not isinstance(obj, dict):
        return obj
    ((tag, val),) = obj.items()
    if tag == "T":
        return _untensor(val)
    if tag == "b":
        return base64.b64decode(val)
    if tag == "l":
        return [_dec(v) for v in val]
    if tag == "t":
        return tuple(_dec(v) for v in val)
    if tag == "s":
        return {_dec(v) for v in val}
    if tag == "d":
        return {k: _dec(v) for k, v in val.items()}
    if tag == "m":
        return {_dec(k): _dec(v) for k, v in val}
    raise ValueError(f"unknown tag {tag!r} in an encoded object")


def encode(obj: Any) -> bytes:
    """Encode ``obj`` to bytes; raises TypeError naming an unsupported type."""
    return json.dumps(_enc(obj), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """Decode bytes produced by :func:`encode`."""
    return _dec(json.loads(data.decode()))
