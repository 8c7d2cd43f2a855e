"""Which layers each pipeline stage holds, the chunk module that runs them, micro-batching.

Pure helpers for the runner: :func:`split_layers` turns a layer list and a balance policy into
contiguous index ranges, one per virtual stage; :class:`Chunk` is an ``nn.Sequential`` of one
stage's layers that passes tuples on as positional arguments; :func:`split_batch` cuts a batch
into equal micro-batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from phalanx.pipeline.balance import balance_stages, check_balance, parameter_costs, time_costs

__all__ = ["Chunk", "as_tuple", "split_batch", "split_layers"]

BALANCE_POLICIES = ("params", "time")


def as_tuple(x: Any) -> tuple[Any, ...]:
    """``x`` if it is a tuple (a list becomes one), else ``(x,)``."""
    if isinstance(x, tuple):
        return x
    return tuple(x) if isinstance(x, list) else (x,)


def _costs(layers: Sequence[nn.Module], balance: str, example_input: Any) -> list[float]:
    if balance == "params":
        return parameter_costs(layers)
    if example_input is None:
        raise ValueError("balance='time' needs example_input= (what the first layer takes)")
    return time_costs(layers, example_input)


def split_layers(
    layers: Sequence[nn.Module] | nn.Sequential,
    num_stages: int,
    balance: Sequence[int] | str | None = None,
    example_input: Any = None,
) -> list[list[int]]:
    """Layer indices of each stage: contiguous, in order, every stage non-empty.

    Args:
        layers: The model as a list of layers (or an ``nn.Sequential``).
        num_stages: Number of (virtual) stages.
        balance: ``None`` (near-equal layer counts), ``"params"`` (balance parameter counts),
            ``"time"`` (balance measured forward+backward time on ``example_input``) or an
            explicit list of layers per stage.
        example_input: What the first layer takes; needed by ``balance="time"``.

    Raises:
        ValueError: more stages than layers, an unknown policy, a bad explicit balance.
    """
    mods = list(layers)
    if isinstance(balance, str):
        if balance not in BALANCE_POLICIES:
            raise ValueError(f"balance={balance!r} is not None, a list, 'params' or 'time'")
        sizes = balance_stages(_costs(mods, balance, example_input), num_stages)
    elif balance is None:
        sizes = balance_stages([1.0] * len(mods), num_stages)
    else:
        sizes = check_balance(balance, len(mods), num_stages)
    parts, start = [], 0
    for n in sizes:
        parts.append(list(range(start, start + n)))
        start += n
    return parts


class Chunk(nn.Sequential):
    """One stage's layers. Submodules keep their index in the whole model as their name.

    Unlike ``nn.Sequential``, a layer returning a tuple feeds the next layer its items as
    positional arguments, so stages may pass several tensors along.
    """

    def __init__(self, layers: Sequence[nn.Module], indices: Sequence[int]) -> None:
        super().__init__(OrderedDict((str(i), layers[i]) for i in indices))

    def forward(self, *inputs: Any) -> Any:
        """Apply the layers in order; returns what the last returns."""
        x: Any = inputs
        for layer in self:
            x = layer(*x)
            x = as_tuple(x)
        return x[0] if len(x) == 1 else x


def split_batch(batch: Any, num_microbatches: int, name: str) -> list[tuple[Any, ...]]:
    """Cut a tensor or tuple of tensors into equal micro-batches along dim 0.

    Returns one tuple (of the pieces of each tensor) per micro-batch.

    Raises:
        ValueError: the batch size is not divisible by ``num_microbatches``, or the tensors
            disagree on it.
    """
    tensors = as_tuple(batch)
    sizes = {t.shape[0] for t in tensors if isinstance(t, torch.Tensor)}
    if len(sizes) != 1 or len(tensors) != sum(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(
            f"{name} must be a tensor or tuple of tensors with one batch size, "
            f"got batch sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    if size == 0 or size % num_microbatches:
        raise ValueError(
            f"{name} has batch size {size}, not divisible by micro_batches={num_microbatches}; "
            "the pipeline needs equal micro-batches"
        )
    pieces = [t.chunk(num_microbatches, dim=0) for t in tensors]
    return [tuple(p[i] for p in pieces) for i in range(num_microbatches)]
