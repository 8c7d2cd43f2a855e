"""Every rank starts from rank 0's build, where each rank keeps a piece of the model it built.

``Job(seed=None)`` (the default) touches no random generator, so each rank's model is drawn from
its own random state. DDP, ``Zero`` and a pipeline's replicas broadcast one rank's parameters
anyway; the strategies here keep, on each rank, a piece of that rank's own build, and without
this the model they train would be a patchwork of different draws:

- ``Mesh`` with ``tp > 1``: each rank slices its tensor-parallel shard from its own build
  (column shards of one layer taken from different matrices);
- ``PS`` with several servers: each server serves its shard of its own build;
- ``TorchFSDP``: ``fully_shard`` keeps each rank's DTensor shard of its own build (torch's FSDP1
  had ``sync_module_states=True`` for this; FSDP2 leaves it to the caller).

So these strategies broadcast the whole model (parameters and buffers) from global rank 0
before splitting it: one coalesced broadcast per (device, dtype), once, at set-up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.data_parallel.module_state import broadcast_coalesced

__all__ = ["start_from_rank0"]


@torch.no_grad()
def start_from_rank0(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``model``'s parameters and buffers with global rank 0's (which must be in
    ``group``). Collective over ``group``; a no-op on one rank."""
    if dist.get_world_size(group) == 1:
        return
    tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
    broadcast_coalesced(tensors, 0, group)
