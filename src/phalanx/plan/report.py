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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from phalanx.plan.storage import StorageKey, storage_key, storage_nbytes, tensors_in

__all__ = ["MemoryReport", "format_mb", "memory_report"]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model states held by this rank."""

    params: int
    """Bytes of parameter storage (``model.parameters()``)."""
    grads: int
    """Bytes of gradient storage (``p.grad``, plus the optimizer's ``grad_bytes()`` if any)."""
    optimizer: int
    """Bytes of optimizer state (``optimizer.state`` tensors, or ``state_bytes()`` if any)."""
    activations: int = 0
    """Bytes one forward of the ``batch`` given to :func:`memory_report` holds for backward
    (:func:`phalanx.plan.measure.activation_bytes`; with activation checkpointing, what it
    keeps); 0 when no batch was given."""

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state (+ activations, when measured), in bytes."""
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer", "activations", "total"}`` in bytes."""
        return {**asdict(self), "total": self.total}

    def __str__(self) -> str:
        shown = {k: v for k, v in self.as_dict().items() if k != "activations" or v}
        return ", ".join(f"{name} {format_mb(value)}" for name, value in shown.items())


def format_mb(nbytes: float) -> str:
    """``nbytes`` in megabytes (10^6 bytes) to three significant figures, e.g. ``'3.27 MB'``."""
    mb = nbytes / 1e6
    if mb == 0:
        return "0 MB"
    rounded = float(f"{mb:.3g}")
    decimals = max(0, 2 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:.{decimals}f} MB"


def _count(tensors: Iterable[torch.Tensor], seen: set[StorageKey]) -> int:
    """Bytes of the storages of ``tensors`` not yet in ``seen`` (which this updates)."""
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += storage_nbytes(t)
    return total


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


def memory_report(
    model: nn.Module,
    optimizer: object | None = None,
    *,
    batch: Sequence[Any] | None = None,
    loss_fn: Callable[[Any, Sequence[Any]], torch.Tensor] | None = None,
) -> MemoryReport:
    """Count the parameter, gradient and optimizer-state bytes this rank holds.

    Args:
        model: The module whose ``parameters()`` this rank holds (for a parameter-sharded
            wrapper, its shard parameters).
        optimizer: ``None``, a ``torch.optim.Optimizer``, or any object with a ``state``
            mapping or a ``state_bytes()`` method (see the module docstring for the hooks).
        batch: The inputs of one micro-batch (``model(*batch)``): also measure the activations
            one forward holds for backward (it runs one forward, without backward).
        loss_fn: ``loss_fn(output, batch)``, with ``batch``: the loss whose graph is measured
            (default: as ``phalanx plan``, the output's own or its mean).

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
        state_bytes = _count(tensors_in(state), seen) if state is not None else 0
    activations = 0
    if batch is not None:
        from phalanx.plan.measure import activation_bytes  # loads torch's profiler: on use

        activations = activation_bytes(model, batch, loss_fn)
    return MemoryReport(param_bytes, grad_bytes, state_bytes, activations)
