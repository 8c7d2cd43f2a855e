"""Gradient-norm clipping when the model is split: the norm of the *whole* model's gradient.

Each rank holds part of the gradient: its pipeline stage's parameters and its tensor-parallel
shards, plus parameters that tensor parallel leaves replicated (LayerNorms, a row-parallel
layer's bias), whose gradients are identical on every tensor-parallel rank. The sum of
``|g|^p`` (max ``|g|`` for the inf-norm) is combined over the tensor and pipeline groups with
each replicated parameter counted on tensor rank 0 only (as Megatron-LM does), so every rank
clips by the same factor as the unsplit model. Data-parallel replicas already hold averaged,
identical gradients: they need no reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.mesh.checkpoint import tp_slices
from phalanx.mesh.groups import ParallelGroups
from phalanx.sharding.clip import check_norm_type, local_power, reduce_power, scale_

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    module: nn.Module, max_norm: float, groups: ParallelGroups, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale the gradients of ``module`` (this rank's part) so the whole model's norm <= max_norm.

    Returns:
        The whole model's gradient ``norm_type``-norm before clipping (the same on every rank).
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    p = check_norm_type(norm_type)
    sharded = set(tp_slices(module)) if groups.topology.tp > 1 else set()
    count_replicated = groups.index("tp") == 0
    params = [q for q in module.parameters() if q.grad is not None]
    grads = [q.grad for q in params if q.grad is not None]
    counted = [
        q.grad for q in params if q.grad is not None and (id(q) in sharded or count_replicated)
    ]
    device = grads[0].device if grads else torch.device("cpu")
    power = local_power(counted, p, device)
    for group in (groups.tp, groups.pp):
        if dist.get_world_size(group) > 1:
            reduce_power(power, p, group)
    return scale_(grads, power, p, max_norm)
