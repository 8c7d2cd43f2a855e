"""Pure bucket planning for data-parallel gradient all-reduce.

Parameters are taken in **reverse registration order** (backward produces the gradients of the
last layers first, so the first bucket fills and launches while earlier layers still compute)
and packed greedily into flat buckets under a byte cap, one bucket per (device, dtype). As in
torch's DDP, the first bucket has a small cap (1 MiB) so communication starts early.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FIRST_BUCKET_BYTES", "BucketPlan", "ParamSpec", "plan_buckets"]

FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    index: int
    """Registration index among the parameters that require gradients."""
    numel: int
    element_size: int
    dtype: str
    device: str


@dataclass(frozen=True)
class BucketPlan:
    """One flat bucket: parameter indices in buffer order, with their offsets."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    device: str


def plan_buckets(
    specs: list[ParamSpec], cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[BucketPlan]:
    """Assign parameters (reverse order) to buckets under ``cap_bytes``; first bucket smaller.

    A parameter larger than the cap gets a bucket of its own. Buckets are returned in launch
    order (bucket 0 holds the last-registered parameters).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive bytes, got {cap_bytes}")
    open_: dict[tuple[str, str], list[ParamSpec]] = {}
    done: list[list[ParamSpec]] = []
    for spec in reversed(specs):
        key = (spec.device, spec.dtype)
        current = open_.setdefault(key, [])
        cap = first_cap_bytes if not done and first_cap_bytes > 0 else cap_bytes
        size = sum(s.numel * s.element_size for s in current)
        if current and size + spec.numel * spec.element_size > min(cap, cap_bytes):
            done.append(current)
            current = open_[key] = []
        current.append(spec)
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
    )
