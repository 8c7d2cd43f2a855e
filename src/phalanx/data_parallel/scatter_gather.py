"""Scatter inputs to devices and gather outputs back (DataParallel), or map over them (DDP).

Tensors are split along ``dim`` into uneven chunks (a batch of 5 on 2 devices is 3 + 2), nested
tuples (named ones too), lists and dicts are walked, and anything else is handed to every replica
unchanged. :func:`map_tensors` is the same walk applying one function (move, cast) to each
tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["gather", "map_tensors", "num_chunks", "scatter"]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor in it (nested tuples, lists, dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(fn, o) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(fn, o) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _tensors(item, f"{path}[{key!r}]")


def _check_dim(t: torch.Tensor, dim: int, path: str) -> None:
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"dim={dim} is out of range for {path} of shape {tuple(t.shape)} "
            f"(valid: {-t.dim()}..{t.dim() - 1}); pass the batch dimension as DataParallel(dim=...)"
        )


def num_chunks(args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, devices: int) -> int:
    """Replicas to run: one per device, fewer if the batch is smaller (at least one)."""
    sizes = [devices]
    for path, t in _tensors((args, kwargs), "inputs"):
        if t.dim() > 0:  # 0-dim tensors are replicated, not split
            _check_dim(t, dim, path)
            sizes.append(t.size(dim))
    return max(1, min(sizes))


def _rebuild(like: Any, items: Sequence[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    return type(like)(items)


def scatter(obj: Any, devices: list[torch.device], dim: int) -> list[Any]:
    """One copy of ``obj`` per device: tensors split along ``dim`` (3 + 2 for 5 on 2 devices)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj.to(d) for d in devices]
        chunks = torch.tensor_split(obj, len(devices), dim)
        return [chunk.to(d) for chunk, d in zip(chunks, devices)]
    if isinstance(obj, list | tuple):
        parts = [scatter(item, devices, dim) for item in obj]
        return [_rebuild(obj, [p[i] for p in parts]) for i in range(len(devices))]
    if isinstance(obj, dict):
        parts_by_key = {k: scatter(v, devices, dim) for k, v in obj.items()}
        return [type(obj)((k, p[i]) for k, p in parts_by_key.items()) for i in range(len(devices))]
    return [obj] * len(devices)  # anything else is passed to every replica as is


def gather(outputs: list[Any], device: torch.device, dim: int, path: str = "output") -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``device``, recursing into containers."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            warnings.warn(
                "DataParallel: the replicas returned scalars; gathering them into a vector of one "
                "value per replica (reduce it, e.g. .mean(), or return per-sample values)",
                stacklevel=2,
            )
            return torch.stack([o.to(device) for o in outputs])
        _check_dim(first, dim, path)
        return torch.cat([o.to(device) for o in outputs], dim)
    if first is None:
        return None
    if isinstance(first, list | tuple):
        items = [
            gather(list(col), device, dim, f"{path}[{i}]") for i, col in enumerate(zip(*outputs))
        ]
        return _rebuild(first, items)
    if isinstance(first, dict):
        return type(first)(
            (k, gather([o[k] for o in outputs], device, dim, f"{path}[{k!r}]")) for k in first
        )
    raise TypeError(
        f"DataParallel cannot gather {path} of type {type(first).__name__}; "
        "return tensors, or tuples, lists or dicts of them"
    )
