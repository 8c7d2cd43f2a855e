"""Gradient-norm clipping when the model is split: the norm of the *whole* model's gradient.

Each rank holds part of the gradient: its pipeline stage's parameters and its tensor-parallel
shards, plus parameters that tensor parallel leaves replicated (LayerNorms, a row-parallel
layer's bias), whose gradients are identical on every tensor-parallel rank. The squared norm is
summed over the tensor and pipeline groups with each replicated parameter counted on tensor
rank 0 only (as Megatron-LM does), so every rank clips by the same factor as the unsplit model.
Data-parallel replicas already hold averaged, identical gradients: they need no reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as C
from phalanx.mesh.checkpoint import tp_slices
from phalanx.mesh.groups import ParallelGroups

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(module: nn.Module, max_norm: float, groups: ParallelGroups) -> torch.Tensor:
    """Scale the gradients of ``module`` (this rank's part) so the whole model's norm <= max_norm.

    Returns:
        The whole model's gradient 2-norm before clipping (the same on every rank).
    """
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    sharded = set(tp_slices(module)) if groups.topology.tp > 1 else set()
    count_replicated = groups.index("tp") == 0
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    counted = [
        p.grad
        for p in module.parameters()
        if p.grad is not None and (id(p) in sharded or count_replicated)
    ]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        sq += g.detach().float().pow(2).sum()
    for group in (groups.tp, groups.pp):
        if dist.get_world_size(group) > 1:
            C.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
