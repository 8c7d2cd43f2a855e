"""Where fp16's gradient scaler finds a ZeRO rank's gradients, and who agrees on overflows.

- ZeRO-1/2 (``phalanx.ZeroRedundancyOptimizer``): the rank steps its ranges of the averaged
  gradient (``sharding/owned.py``: each ``OwnedRange.tensor.grad``, held by the inner
  optimizer), not the parameters' ``.grad`` (stage 2 has freed those during backward). The
  scaler reduces them first (:meth:`~phalanx.ZeroRedundancyOptimizer.owned_grads`, the
  reduce-scatter ``step()`` would run anyway) and unscales the inner optimizer's gradients.
- ZeRO-3 (``phalanx.FullyShardedDataParallel``): the optimizer steps the flat shards, whose
  gradients are already reduced: it is its own holder.

Either way each rank sees only its part of the gradient, so one rank may find an inf that the
others do not: the found-inf flag is agreed (MAX) over the data-parallel group, and every rank
skips the step and backs off its scale together.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.train.grad_scaler import GradShards

__all__ = ["zero_grad_shards"]


def zero_grad_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> GradShards | None:
    """The :class:`GradShards` of ``optimizer`` under ZeRO-1/2, or of ``model`` under ZeRO-3
    (None for anything else: its own gradients, unagreed)."""
    from phalanx.sharding import ZeroRedundancyOptimizer
    from phalanx.sharding.zero3 import FullyShardedDataParallel

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        agree = optimizer.world > 1
        group = optimizer.process_group
        return GradShards(optimizer.optim, agree, group, optimizer.owned_grads)
    if isinstance(model, FullyShardedDataParallel):
        agree = torch.distributed.is_initialized() and (
            torch.distributed.get_world_size(model.process_group) > 1
        )
        return GradShards(optimizer, agree, model.process_group)
    return None
