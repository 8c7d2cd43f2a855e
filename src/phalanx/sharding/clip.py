"""Gradient clipping when each rank holds part of the gradients (ZeRO-1/2 ranges, ZeRO-3 shards,
a mesh's stages and tensor shards).

``torch.nn.utils.clip_grad_norm_`` on the whole model, computed from pieces: each rank reduces
its pieces' sum of ``|g|^p`` (max ``|g|`` for the inf-norm), all-reduces combine the ranks, and
every piece is scaled by the same coefficient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c

__all__ = ["check_norm_type", "clip_pieces_", "local_power", "reduce_power", "scale_"]

INF = float("inf")


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float; raises ``ValueError`` unless it is > 0 (or inf)."""
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    return p


def local_power(grads: Sequence[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm: the sum of ``|g|^p`` over ``grads`` (max ``|g|`` for inf)."""
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        norm = torch.linalg.vector_norm(g.detach(), p).float()
        local = torch.maximum(local, norm) if p == INF else local + norm**p
    return local


def reduce_power(local: torch.Tensor, p: float, group: dist.ProcessGroup | None) -> None:
    """Combine :func:`local_power` over ``group`` in place (sum, or max for the inf-norm)."""
    c.all_reduce(local, dist.ReduceOp.MAX if p == INF else dist.ReduceOp.SUM, group=group)


@torch.no_grad()
def scale_(
    grads: Sequence[torch.Tensor], power: torch.Tensor, p: float, max_norm: float
) -> torch.Tensor:
    """Scale ``grads`` so that the norm ``power`` stands for is <= ``max_norm``; return the norm."""
    total = power if p == INF else power ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


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
    p = check_norm_type(norm_type)
    local = local_power(grads, p, device)
    if world > 1:
        reduce_power(local, p, group)
    return scale_(grads, local, p, max_norm)
