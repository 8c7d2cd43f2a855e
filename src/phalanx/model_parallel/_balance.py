"""Pure planning: cut a chain of layers into contiguous parts of balanced cost.

The device holding the most parameters bounds the model size a split can fit (seed 001 §4:
two 8 GB layers on two 10 GB GPUs), so the primary goal is the *linear partition* problem:
contiguous parts minimising the largest part cost. Many cuts usually tie on that (ReLU and
pooling layers cost nothing), so among them we take the one with the smallest sum of squared
part costs (the most even spread), and among those the latest cuts (a free layer stays with the
layer before it: ``conv, relu | fc`` rather than ``conv | relu, fc``).

Phase 1 is the balancer's one recurrence, :func:`phalanx.pipeline.balance.min_max_cost`
(pipeline stages break its ties the other way: earlier stages take more). Both phases are
O(parts · layers²) dynamic programmes, instant for the tens to hundreds of layers a model has.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from phalanx.pipeline.balance import min_max_cost

__all__ = ["balance_by_cost"]

_INF = float("inf")


def balance_by_cost(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` contiguous non-empty runs; return each run's length.

    Args:
        costs: Non-negative cost of each layer, in order (e.g. its parameter count). All
            zero means "no information": the layers are then spread by count.
        parts: Number of runs (devices), ``1 <= parts <= len(costs)``.

    Returns:
        Layer counts per run, summing to ``len(costs)``; the largest run cost is minimal.

    Raises:
        ValueError: ``parts`` out of range, or a negative cost.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    if parts > len(costs):
        raise ValueError(f"cannot cut {len(costs)} layer(s) into parts={parts} non-empty parts")
    negative = [(i, c) for i, c in enumerate(costs) if c < 0]
    if negative:
        raise ValueError(f"costs must be >= 0, got (index, cost) {negative}")
    if not any(costs):  # nothing to weigh (no parameters at all): spread the layers evenly
        costs = [1] * len(costs)
    prefix: list[float] = [0]  # ints stay exact ints: ties are decided exactly
    for c in costs:
        prefix.append(prefix[-1] + c)
    limit = min_max_cost(prefix, parts)
    cuts = _even_cuts(prefix, parts, limit)
    return [b - a for a, b in itertools.pairwise(cuts)]


def _even_cuts(prefix: list[float], parts: int, limit: float) -> list[int]:
    """Phase 2: among cuts with every part <= ``limit``, minimise the sum of squared costs."""
    n = len(prefix) - 1
    score = [0.0] + [_INF] * n
    back: list[list[int]] = []
    for p in range(1, parts + 1):
        nxt, arg = [_INF] * (n + 1), [0] * (n + 1)
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):  # ascending j with <=: ties go to the latest cut
                part = prefix[i] - prefix[j]
                if part <= limit and score[j] + part * part <= nxt[i]:
                    nxt[i], arg[i] = score[j] + part * part, j
        score = nxt
        back.append(arg)
    cuts = [n]
    for arg in reversed(back):
        cuts.append(arg[cuts[-1]])
    return cuts[::-1]
