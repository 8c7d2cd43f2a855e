"""``phalanx.TorchZero1()``: torch's DDP with torch's ``ZeroRedundancyOptimizer`` (baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phalanx.comm.group import World
from phalanx.train.comm_timing import time_torch_zero
from phalanx.train.strategies.base import JobOptions, Runner
from phalanx.train.strategies.optimizers import accepted, options
from phalanx.train.strategies.torch_ddp import TorchDDP

__all__ = ["TorchZero1"]


@dataclass(frozen=True)
class TorchZero1(TorchDDP):
    """torch DDP plus torch's ZeRO-1 optimizer, the baseline of ``phalanx.Zero(stage=1)``."""

    name: ClassVar[str] = "torch-zero1"
    rebuilds_optimizer: ClassVar[bool] = True

    def start(self, world: World, job: JobOptions) -> Runner:
        return _TorchZeroRunner(self, world)

    def shard_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [{**options(g), "params": g["params"]} for g in optimizer.param_groups]
        defaults = accepted(type(optimizer), optimizer.defaults)
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)

    def measure_comm(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = super().measure_comm(model, optimizer)
        zero = isinstance(optimizer, ZeroRedundancyOptimizer) and time_torch_zero(optimizer)
        return ddp and zero


class _TorchZeroRunner(Runner):
    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if saving and isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.consolidate_state_dict(to=0)  # torch gathers to rank 0 first
        return self.model, self.optimizer
