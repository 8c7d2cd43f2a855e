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


def narrow(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` back in its original ``dtype`` (itself when it travelled unchanged)."""
    return t if t.dtype == dtype else t.to(dtype)
