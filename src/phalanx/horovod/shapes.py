"""Shape rows: a tensor's rank, dtype and sizes as a fixed-width int64 row, for exchange.

Collectives whose first dimension may differ across ranks (allgather, alltoall) first exchange
these rows, so that every rank can check the others' shapes and name the rank that differs.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import torch

__all__ = ["MAX_DIMS", "describe", "shape_row"]

MAX_DIMS = 64


@functools.cache
def _dtype_names() -> dict[int, str]:
    dtypes = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return {_dtype_code(d): str(d).removeprefix("torch.") for d in dtypes}


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def describe(row: list[int], any_first: bool = False) -> str:
    """Human form of a row, e.g. ``[3, 4] float32`` (``[*, 4] float32`` with ``any_first``)."""
    dims: list[Any] = row[2 : 2 + row[0]]
    if any_first and dims:
        dims = ["*", *dims[1:]]
    return f"[{', '.join(map(str, dims))}] {_dtype_names().get(row[1], '?')}"


def shape_row(x: torch.Tensor) -> torch.Tensor:
    """``[ndim, dtype code, size 0, size 1, ..., 0 padding]`` on ``x``'s device."""
    if x.dim() > MAX_DIMS:
        raise ValueError(f"tensors of more than {MAX_DIMS} dimensions are not supported, got "
                         f"{x.dim()}")  # fmt: skip
    row = [x.dim(), _dtype_code(x.dtype), *x.shape] + [0] * (MAX_DIMS - x.dim())
    return torch.tensor(row, dtype=torch.int64, device=x.device)
