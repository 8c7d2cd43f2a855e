"""Bytes of model states this rank actually holds, measured from its tensors.

The counterpart of :func:`phalanx.plan.estimate`: ``estimate`` predicts parameter, gradient and
optimizer-state bytes per device from the ZeRO paper's formulas; :func:`memory_report` counts
them on a live model and optimizer, so a test (or a user) can hold one against the other.

Every tensor is counted by its *storage*, once: views into one flat buffer (ZeRO-1 lays the
parameters out that way) count the whole buffer once, tied weights count once, and a storage
already counted as a parameter is not counted again as a gradient or as optimizer state.

Duck-typed hooks on the optimizer, for sharded optimizers that keep state outside
``optimizer.state`` or gradients outside ``p.grad``:

- ``optimizer.state_bytes() -> int``: replaces walking ``optimizer.state`` (ZeRO-1's
  :class:`phalanx.sharding.ZeroRedundancyOptimizer` has it).
- ``optimizer.grad_bytes() -> int``: added to the bytes of the parameters' ``.grad`` (a ZeRO-2
  optimizer that keeps gradient shards outside ``p.grad`` reports them here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryReport", "format_mb", "memory_report"]

StorageKey = tuple[Any, ...]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model states held by this rank."""

    params: int
    """Bytes of parameter storage (``model.parameters()``)."""
    grads: int
    """Bytes of gradient storage (``p.grad``, plus the optimizer's ``grad_bytes()`` if any)."""
    optimizer: int
    """Bytes of optimizer state (``optimizer.state`` tensors, or ``state_bytes()`` if any)."""

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state, in bytes."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer", "total"}`` in bytes."""
        return {**asdict(self), "total": self.total}

    def __str__(self) -> str:
        parts = [f"{name} {format_mb(value)}" for name, value in self.as_dict().items()]
        return ", ".join(parts)


def format_mb(nbytes: float) -> str:
    """``nbytes`` in megabytes (10^6 bytes) to three significant figures, e.g. ``'3.27 MB'``."""
    mb = nbytes / 1e6
    if mb == 0:
        return "0 MB"
    rounded = float(f"{mb:.3g}")
    decimals = max(0, 2 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:.{decimals}f} MB"


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


def _count(tensors: Iterable[torch.Tensor], seen: set[StorageKey]) -> int:
    """Bytes of the storages of ``tensors`` not yet in ``seen`` (which this updates)."""
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += storage_nbytes(t)
    return total


def _tensors_in(obj: object) -> Iterable[torch.Tensor]:
    """Every tensor in ``obj``, through any nesting of mappings, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors_in(value)


def _hook(optimizer: object, name: str) -> int | None:
    """``optimizer.<name>()`` as an int, or None when the optimizer has no such method."""
    method = getattr(optimizer, name, None)
    if not callable(method):
        return None
    value = method()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"memory_report: optimizer.{name}() must return an int, got {type(value).__name__}"
        )
    return value


def memory_report(model: nn.Module, optimizer: object | None = None) -> MemoryReport:
    """Count the parameter, gradient and optimizer-state bytes this rank holds.

    Args:
        model: The module whose ``parameters()`` this rank holds (for a parameter-sharded
            wrapper, its shard parameters).
        optimizer: ``None``, a ``torch.optim.Optimizer``, or any object with a ``state``
            mapping or a ``state_bytes()`` method (see the module docstring for the hooks).

    Returns:
        Exact bytes, each storage counted once (0-dim tensors such as Adam's ``step`` too).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` has neither a ``state``
            mapping nor ``state_bytes()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"memory_report: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    state = getattr(optimizer, "state", None)
    has_hook = callable(getattr(optimizer, "state_bytes", None))
    if optimizer is not None and not has_hook and not isinstance(state, Mapping):
        raise TypeError(
            "memory_report: optimizer must be None, a torch.optim.Optimizer or have a `state` "
            f"mapping or a state_bytes() method, got {type(optimizer).__name__}"
        )
    seen: set[StorageKey] = set()
    params = list(model.parameters())
    param_bytes = _count(params, seen)
    grad_bytes = _count((p.grad for p in params if p.grad is not None), seen)
    grad_bytes += _hook(optimizer, "grad_bytes") or 0
    state_bytes = _hook(optimizer, "state_bytes")
    if state_bytes is None:
        state_bytes = _count(_tensors_in(state), seen) if state is not None else 0
    return MemoryReport(params=param_bytes, grads=grad_bytes, optimizer=state_bytes)
