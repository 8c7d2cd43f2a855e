"""``phalanx.TorchFSDP()``: torch's FSDP2 (``fully_shard``), the baseline of ``Zero(stage=3)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phalanx.comm.group import World
from phalanx.train.comm_timing import time_torch_fsdp
from phalanx.train.grad_scaler import GradShards
from phalanx.train.strategies.base import JobOptions, Runner, Strategy
from phalanx.train.strategies.initial_state import start_from_rank0
from phalanx.train.strategies.optimizers import rebuild_one_group, unit_policy

__all__ = ["TorchFSDP"]


@dataclass(frozen=True)
class TorchFSDP(Strategy):
    """``fully_shard`` on each unit and the root, from rank 0's parameters; not checkpointed
    (its parameters are DTensors)."""

    name: ClassVar[str] = "torch-fsdp"
    rebuilds_optimizer: ClassVar[bool] = True

    def start(self, world: World, job: JobOptions) -> Runner:
        return _TorchFSDPRunner(self, world)

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        start_from_rank0(model)  # each rank keeps a shard of its own build (seed=None)
        for unit in unit_policy(model):
            fully_shard(unit)
        fully_shard(model)
        return model

    def shard_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> torch.optim.Optimizer:
        return rebuild_one_group(optimizer, model.parameters(), "torch-fsdp")

    def clip_grad_norm_(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """torch's clip over DTensor gradients: the norm comes back a DTensor, made whole."""
        from torch.distributed.tensor import DTensor

        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return total.full_tensor() if isinstance(total, DTensor) else total

    def grad_shards(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> GradShards | None:
        """fp16: each rank checks its DTensor shards; overflows are agreed over every rank
        (torch 2.13's DTensor unscale was seen to agree by itself; one flag more keeps it so)."""
        return GradShards(optimizer, agree=True) if world.world_size > 1 else None

    def measure_comm(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        return time_torch_fsdp(model)


class _TorchFSDPRunner(Runner):
    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        if not saving:
            return self.model, self.optimizer
        raise ValueError(
            "Job.save() does not checkpoint strategy='torch-fsdp' (a benchmark baseline whose "
            "parameters are DTensors); use strategy='zero3' for resumable sharded training"
        )
