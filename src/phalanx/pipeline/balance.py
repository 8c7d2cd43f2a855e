"""Split a list of layers into contiguous pipeline stages of balanced cost.

A pipeline runs as fast as its slowest stage (every micro-batch passes through each stage), so
the split minimises the largest stage cost: the "linear partition" problem, solved exactly by
dynamic programming, as torchgpipe's ``balance_by_time`` / ``balance_by_size`` do
(Kim et al., 2020). Costs come from parameter counts or measured forward+backward times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from phalanx._check import check_choice, check_ints, fail

__all__ = [
    "balance_arg",
    "balance_stages",
    "check_balance",
    "min_max_cost",
    "parameter_costs",
    "time_costs",
]

BALANCE_NAMES = ("params", "time")


def balance_arg(name: str, value: Any, where: str) -> object:
    """Argument rule of ``balance``: "params", "time" or a list of layers per stage (>= 1).

    Whether the list fits the model and the pipeline is :func:`check_balance`'s to say, later.
    """
    if isinstance(value, str):
        return check_choice(name, value, BALANCE_NAMES, where=where)
    if not isinstance(value, list | tuple):
        what = "'params', 'time' or a list of layers per stage (ints >= 1)"
        raise fail(name, value, what, where=where, error=TypeError)
    return check_ints(name, value, min=1, where=where)


def _check_costs(costs: Sequence[float], num_stages: int) -> list[float]:
    values = [float(c) for c in costs]
    bad = [c for c in values if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"costs must be finite and >= 0, got {bad[:3]}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > len(values):
        raise ValueError(
            f"more stages than layers: num_stages={num_stages} but only {len(values)} layers; "
            "every stage needs at least one layer"
        )
    return values


def min_max_cost(prefix: Sequence[float], parts: int) -> float:
    """The smallest achievable largest-part cost of a contiguous split into ``parts`` non-empty
    parts (the linear partition problem; dynamic programme over prefix sums, O(parts · n²)).

    The one balancer recurrence: pipeline stages (:func:`balance_stages`) and
    ``split_across_devices`` (:mod:`phalanx.model_parallel._balance`) differ only in how they
    break ties under this bound.

    Args:
        prefix: ``prefix[i]`` is the total cost of the first ``i`` layers (``prefix[0] == 0``);
            ints stay exact.
        parts: ``1 <= parts <= len(prefix) - 1``.
    """
    n = len(prefix) - 1
    if not 1 <= parts <= n:
        raise ValueError(f"min_max_cost: parts must be in [1, {n}], got {parts!r}")
    best: list[float] = [0.0] + [math.inf] * n  # best[i]: first i layers in the parts so far
    for p in range(1, parts + 1):
        nxt = [math.inf] * (n + 1)
        for i in range(p, n - (parts - p) + 1):  # leave a layer for each later part
            nxt[i] = min(max(best[j], prefix[i] - prefix[j]) for j in range(p - 1, i))
        best = nxt
    return best[n]


def balance_stages(costs: Sequence[float], num_stages: int) -> list[int]:
    """Stage sizes (layers per stage) of the contiguous split minimising the largest stage cost.

    Ties are broken deterministically: among optimal splits, earlier stages take as many layers
    as they can (greedy fill under the optimal bottleneck, leaving one layer per later stage).

    Args:
        costs: Cost of each layer, in order (>= 0).
        num_stages: Number of stages; every stage gets at least one layer.

    Raises:
        ValueError: ``num_stages > len(costs)`` ("more stages than layers"), or a bad cost.
    """
    values = _check_costs(costs, num_stages)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    cap = min_max_cost(prefix, num_stages)
    n, sizes, start = len(values), [], 0
    for stage in range(num_stages - 1):
        # Greedy and optimal agree: each greedy cut is at least as far as any optimal split's.
        end = start + 1
        last = n - (num_stages - stage - 1)  # leave one layer for each later stage
        while end < last and prefix[end + 1] - prefix[start] <= cap:
            end += 1
        sizes.append(end - start)
        start = end
    sizes.append(n - start)
    return sizes


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate an explicit ``balance=[n0, n1, ...]``: one entry per stage, each >= 1, sum n."""
    sizes = list(balance)
    if any(isinstance(b, bool) or not isinstance(b, int) for b in sizes):
        raise TypeError(f"balance must be a list of ints, got {balance!r}")
    if len(sizes) != num_stages:
        raise ValueError(
            f"balance={sizes} has {len(sizes)} entries but the pipeline has {num_stages} "
            "stages (group size x chunks)"
        )
    if any(b < 1 for b in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"balance={sizes} must have every entry >= 1 and sum to the number of layers "
            f"{num_layers}, got sum {sum(sizes)}"
        )
    return sizes


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Number of parameter elements of each layer (a proxy for its memory and compute)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_(True) if x.is_floating_point() else x


def _time_layer(layer: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[float, Any]:
    """One forward+backward of ``layer``; gradients via ``autograd.grad`` leave ``.grad`` alone."""
    start = time.perf_counter()
    out = layer(*inputs)
    outs = [o for o in _as_tuple(out) if o.requires_grad]
    wrt = [t for t in inputs if t.requires_grad] + [
        p for p in layer.parameters() if p.requires_grad
    ]
    if outs and wrt:
        grads = [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    if out is not None and isinstance(out, torch.Tensor) and out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - start, out


def time_costs(layers: Sequence[nn.Module], example_input: Any, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds of each layer on ``example_input`` (median of runs).

    Each layer is fed the previous layer's output, as in the pipeline. Parameter ``.grad`` is
    not touched (gradients are taken with ``torch.autograd.grad``).

    Args:
        layers: The layers, in order.
        example_input: A tensor (or tuple of tensors) the first layer accepts; one sample or a
            small micro-batch.
        repeats: Timed runs per layer after one warm-up run; the median counts.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    costs, x = [], tuple(_leaf(t) for t in _as_tuple(example_input))
    for layer in layers:
        _time_layer(layer, x)  # warm-up: lazy init, allocator
        runs = [_time_layer(layer, x) for _ in range(repeats)]
        costs.append(statistics.median(t for t, _ in runs))
        x = tuple(_leaf(t) for t in _as_tuple(runs[-1][1]))
    return costs
