"""Uneven inputs for ``DistributedDataParallel``: a joined rank shadows the others' collectives.

``DistributedDataParallel`` is a torch ``Joinable``, so it works inside ``ddp.join()`` and inside
torch's ``Join([ddp, optimizer, ...])`` next to other joinables (torch's or phalanx's
``ZeroRedundancyOptimizer``). Per iteration a training rank issues, in this order: the join
context's "not joined" all-reduce (first joinable only), the buffer broadcast (preceded by an
all-reduce that picks a rank still training), the "sync gradients this time?" all-reduce, then in
backward one collective per bucket and, with ``find_unused_parameters``, the usage all-reduce.
The hook below issues the same sequence with zeros, exactly as torch's DDP does, so phalanx and
torch ranks' protocols match collective for collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from phalanx.data_parallel.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    """Shadows one training iteration per ``main_hook``; syncs the final model at the end."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Match a training rank's forward and backward collectives with zeros."""
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers(candidate=False)
        should_sync = ddp._agree_on_backward_sync(joined=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync and ddp.reducer is not None:
            ddp.reducer.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of a rank that trained to the end."""
        self.ddp._sync_final_model(is_last_joiner)
