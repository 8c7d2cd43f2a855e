"""Strategies of one process: ``"single"`` (the model as it is) and ``"dp"`` (``DataParallel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from phalanx.comm.group import World
from phalanx.train.strategies.base import Strategy

__all__ = ["DP", "Single"]


@dataclass(frozen=True)
class Single(Strategy):
    """One process, one device: the model unchanged (a world of one)."""

    name: ClassVar[str] = "single"

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        if world.world_size != 1:
            raise ValueError(f"strategy='single' needs world_size=1, got {world.world_size}")
        return model


@dataclass(frozen=True)
class DP(Strategy):
    """One process driving every local device: ``phalanx.DataParallel`` (torch's DP drop-in)."""

    name: ClassVar[str] = "dp"

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from phalanx.data_parallel import DataParallel

        if world.world_size != 1:
            raise ValueError(
                f"strategy='dp' is single-process DataParallel but the job has "
                f"world_size={world.world_size}; use strategy='ddp' with `phalanx run`"
            )
        return DataParallel(model)
