"""``Job.gather``: every replica's values, in rank order, for exact evaluation metrics.

An evaluation loader (``job.loader(..., eval=True)``) gives each replica a contiguous block of
the data with no padding, so a replica's predictions may be longer or shorter than another's.
:func:`gather` all-gathers tensors of any leading size: first each rank's shape and dtype
(checked to agree beyond the first dimension, so a mistake raises the same error on every rank
instead of hanging or mixing bytes), then the data padded to the longest, cut back and joined.
Nothing is dropped: with nothing padded there is nothing to guess, unlike Accelerate's
``gather_for_metrics``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.pipeline.p2p import DTYPES

__all__ = ["gather"]

_DTYPES = DTYPES
"""The dtypes :func:`gather` sends, each named by its index (the pipeline header's codes)."""

Number = int | float | bool


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _shapes(t: torch.Tensor, group: dist.ProcessGroup | None, where: str) -> list[tuple[int, ...]]:
    """Every rank's shape, after checking that they agree beyond the first dimension."""
    dev = t.device
    ndims = _all_gather(torch.tensor([t.dim()], device=dev), group)
    if len({int(n) for n in ndims}) > 1:
        dims = [int(n) for n in ndims]
        raise ValueError(f"{where}: the ranks' values have different dimensions {dims}")
    desc = torch.tensor([_DTYPES.index(t.dtype), *t.shape], device=dev)
    got = [tuple(int(v) for v in d.tolist()) for d in _all_gather(desc, group)]
    if len({(d[0], d[2:]) for d in got}) > 1:
        seen = [f"{_DTYPES[d[0]]} {list(d[1:])}" for d in got]
        raise ValueError(
            f"{where}: the ranks' values must agree in dtype and in every dimension but the "
            f"first; got (rank order) {seen}"
        )
    return [d[1:] for d in got]


def gather_tensor(
    value: torch.Tensor, group: dist.ProcessGroup | None, where: str = "Job.gather"
) -> torch.Tensor:
    """Every rank's ``value`` joined along dimension 0 in rank order (0-d values stacked)."""
    if value.dtype not in _DTYPES:
        raise ValueError(f"{where}(value): dtype {value.dtype} is not one of {list(_DTYPES)}")
    flat = value.detach().reshape(1) if value.dim() == 0 else value.detach()
    shapes = _shapes(flat, group, where)
    longest = max(s[0] for s in shapes)
    wire = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # gloo has no bool
    padded = wire.new_zeros((longest, *flat.shape[1:]))
    padded[: flat.shape[0]] = wire
    parts = [p[: s[0]] for p, s in zip(_all_gather(padded, group), shapes, strict=True)]
    return torch.cat(parts).to(flat.dtype)


def gather(
    value: torch.Tensor | Number, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor | list[Number]:
    """``value`` from every rank of ``group``, in rank order. Collective over ``group``.

    A tensor comes back as one tensor (every rank's joined along dimension 0; 0-d values
    stacked); a Python number as a list of every rank's numbers.

    Raises:
        TypeError: ``value`` is neither a tensor nor a number.
        ValueError: the ranks' tensors differ in dtype or beyond the first dimension (raised on
            every rank alike).
    """
    if isinstance(value, torch.Tensor):
        return gather_tensor(value, group)
    if not isinstance(value, int | float):  # bool is an int
        raise TypeError(
            f"Job.gather(value={value!r}): expected a tensor or a number, got "
            f"{type(value).__name__} {value!r}"
        )
    kind: type[Number] = bool if isinstance(value, bool) else int
    if not isinstance(value, int):
        kind = float
    dtype = {bool: torch.bool, int: torch.int64, float: torch.float64}[kind]
    joined = gather_tensor(torch.tensor([value], dtype=dtype, device=device), group)
    return [kind(v) for v in joined.tolist()]
