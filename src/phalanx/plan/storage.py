"""Tensors by the memory behind them: each storage counted once, views and tied weights too."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["StorageKey", "storage_key", "storage_nbytes", "tensors_in"]

StorageKey = tuple[Any, ...]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (torch FSDP2), else ``t`` itself."""
    return getattr(t, "_local_tensor", t)


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identifies the memory behind ``t``: views into one storage share a key."""
    t = _local(t)
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if ptr == 0:  # empty or meta storage: no address to share, count per tensor
        return ("tensor", id(t))
    return (str(t.device), ptr, storage.nbytes())


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (not only the part ``t`` views)."""
    return int(_local(t).untyped_storage().nbytes())


def tensors_in(obj: object) -> Iterable[torch.Tensor]:
    """Every tensor in ``obj``, through any nesting of mappings, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from tensors_in(value)
