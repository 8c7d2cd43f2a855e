"""Dtypes a backend cannot carry travel widened: int16 as int32, uint16 as int32, uint32 as int64.

gloo (and NCCL) have no 16-bit integer collectives, while Horovod's CPU operations take int16.
Widening is exact for data movement, and reductions come back right after narrowing: sums wrap
modulo 2**16 exactly as int16 arithmetic does, and min, max and product agree too.
"""

from __future__ import annotations

import torch

__all__ = ["narrow", "wire_dtype"]

_WIDER = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):  # unsigned types beyond uint8 exist in newer torch only
        _WIDER[getattr(torch, _name)] = _wide


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as."""
    return _WIDER.get(dtype, dtype)


def wire_buffer(tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """The buffer a collective works on: ``tensor`` itself when the operation is in place and
    gloo takes its dtype and layout, else a contiguous copy in the wire dtype."""
    target = tensor.detach()
    wire = wire_dtype(target.dtype)
    if inplace and target.is_contiguous() and wire == target.dtype:
        return target
    return target.to(wire, memory_format=torch.contiguous_format, copy=True)


def land(buf: torch.Tensor, tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """The collective's result as the caller asked for it: narrowed back to ``tensor``'s dtype,
    and written into ``tensor`` when the operation is in place."""
    target = tensor.detach()
    out = narrow(buf, target.dtype)
    if inplace and out is not target:
        target.copy_(out)
    return tensor if inplace else out


def narrow(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` back in its original ``dtype`` (itself when it travelled unchanged)."""
    return t if t.dtype == dtype else t.to(dtype)
