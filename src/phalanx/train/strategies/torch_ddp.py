"""``phalanx.TorchDDP()``: torch's ``DistributedDataParallel``, the baseline of ``phalanx.DDP``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phalanx.comm.group import World
from phalanx.train.comm_timing import time_torch_ddp
from phalanx.train.strategies.base import Strategy, SyncOwner
from phalanx.train.strategies.ddp import device_ids

__all__ = ["TorchDDP"]


@dataclass(frozen=True)
class TorchDDP(Strategy):
    """torch's DDP, its backward wait timed by a hook equal to torch's default all-reduce."""

    name: ClassVar[str] = "torch-ddp"

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        if world.world_size == 1:
            return model
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids(world))

    def sync_owners(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> list[SyncOwner]:
        ddp = torch.nn.parallel.DistributedDataParallel
        return [model] if isinstance(model, ddp) else []

    def measure_comm(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return time_torch_ddp(model)  # its backward wait, for the phase clock
        return True  # one rank: nothing to wait for, and nothing waited
