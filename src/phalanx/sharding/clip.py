"""Gradient clipping when each rank holds part of the gradients (ZeRO-1/2 ranges, ZeRO-3 shards).

``torch.nn.utils.clip_grad_norm_`` on the whole model, computed from pieces: each rank reduces
its pieces' sum of ``|g|^p`` (max ``|g|`` for the inf-norm), one all-reduce combines the ranks,
and every piece is scaled by the same coefficient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c

__all__ = ["clip_pieces_"]


@torch.no_grad()
def clip_pieces_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world: int,
) -> torch.Tensor:
    """Scale ``grads`` (this rank's pieces) so the norm over every rank's is <= ``max_norm``.

    Returns the norm before clipping. Collective when ``world > 1``.

    Raises:
        ValueError: ``norm_type`` is not > 0 (or inf).
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        norm = torch.linalg.vector_norm(g, p).float()
        local = torch.maximum(local, norm) if p == float("inf") else local + norm**p
    if world > 1:
        op = dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM
        c.all_reduce(local, op, group=group)
    total = local if p == float("inf") else local ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
