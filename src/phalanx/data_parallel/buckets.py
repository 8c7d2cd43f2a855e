"""Pure bucket planning for data-parallel gradient all-reduce.

Parameters are taken in **reverse registration order** (backward produces the gradients of the
last layers first, so the first bucket fills and launches while earlier layers still compute)
and packed greedily into flat buckets, one bucket per (device, dtype), each closed once it holds
at least its byte cap: torch's DDP's rule (``_compute_bucket_assignment_by_size``), so the two
issue the same collectives (``tests/unit/test_bucket_plan.py``). Each bucket may have its own
cap: as in torch's DDP, the first one defaults to 1 MiB so communication starts early. A
parameter with sparse gradients gets a bucket of its own (a sparse all-reduce cannot share a
flat buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BucketPlan", "ParamSpec", "plan_buckets"]


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    index: int
    """Registration index among the parameters that require gradients."""
    numel: int
    element_size: int
    dtype: str
    device: str
    sparse: bool = False
    """Its gradients are sparse tensors (``nn.Embedding(sparse=True)``)."""


@dataclass(frozen=True)
class BucketPlan:
    """One flat bucket: parameter indices in buffer order, with their offsets."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    device: str
    sparse: bool = False


def plan_buckets(specs: list[ParamSpec], caps: Sequence[int]) -> list[BucketPlan]:
    """Assign parameters (reverse order) to buckets; bucket ``k``'s byte cap is ``caps[k]``.

    The last cap repeats. A bucket is closed by the parameter that brings it to its cap or past
    it; a parameter with sparse gradients gets a bucket of its own. Buckets are returned in
    launch order (bucket 0 holds the last-registered parameters).
    """
    if not caps or any(c <= 0 for c in caps):
        raise ValueError(f"bucket caps must be positive bytes, got {list(caps)}")
    open_: dict[tuple[str, str], list[ParamSpec]] = {}
    done: list[list[ParamSpec]] = []
    for spec in reversed(specs):
        if spec.sparse:
            done.append([spec])
            continue
        key = (spec.device, spec.dtype)
        current = open_.setdefault(key, [])
        current.append(spec)
        cap = caps[min(len(done), len(caps) - 1)]
        if sum(s.numel * s.element_size for s in current) >= cap:
            done.append(current)
            open_[key] = []
    done.extend(b for b in open_.values() if b)
    return [_layout(b) for b in done]


def _layout(members: list[ParamSpec]) -> BucketPlan:
    offsets, total = [], 0
    for s in members:
        offsets.append(total)
        total += s.numel
    first = members[0]
    return BucketPlan(
        params=tuple(s.index for s in members),
        offsets=tuple(offsets),
        numel=total,
        dtype=first.dtype,
        device=first.device,
        sparse=first.sparse,
    )
