"""``phalanx.DDP()``: phalanx's bucketed data parallel (``phalanx.DistributedDataParallel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phalanx._check import FLAG, check_float, optional, rule
from phalanx.comm.group import World
from phalanx.train.strategies.base import Strategy, SyncOwner, check_fields

__all__ = ["DDP", "device_ids"]


def device_ids(world: World) -> list[int | torch.device] | None:
    """DDP's ``device_ids`` for this rank: its accelerator, or None on CPU."""
    return [world.device.index or 0] if world.device.type == "cuda" else None


@dataclass(frozen=True)
class DDP(Strategy):
    """Every rank holds the whole model; gradients are averaged in buckets during backward.

    Args:
        bucket_cap_mb: Bucket size in MiB (None: DDP's default, 25).
        find_unused_parameters: Allow parameters that get no gradient in some steps.
        gradient_as_bucket_view: Gradients are views into the buckets (saves one copy).
        init_sync: Broadcast rank 0's parameters and buffers when the model is wrapped (torch's
            default); live recovery turns it off and makes the replicas equal itself.
        forward_sync_buffers: Broadcast rank 0's buffers before each forward (torch's default);
            live recovery turns it off and does it at the step instead (``train/live.py``).
    """

    name: ClassVar[str] = "ddp"
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    init_sync: bool = True
    forward_sync_buffers: bool = True

    def __post_init__(self) -> None:
        check_fields(
            self,
            bucket_cap_mb=optional(rule(check_float, above=0)),
            find_unused_parameters=FLAG,
            gradient_as_bucket_view=FLAG,
            init_sync=FLAG,
            forward_sync_buffers=FLAG,
        )

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from phalanx.data_parallel import DistributedDataParallel

        if world.world_size == 1:
            return model
        return DistributedDataParallel(
            model,
            device_ids=device_ids(world),
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            init_sync=self.init_sync,
            forward_sync_buffers=self.forward_sync_buffers,
        )

    def regroup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from phalanx.data_parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            model.regroup()

    def sync_owners(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> list[SyncOwner]:
        from phalanx.data_parallel import DistributedDataParallel

        return [model] if isinstance(model, DistributedDataParallel) else []
