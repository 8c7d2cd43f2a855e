"""``phalanx.Hogwild()``: every rank on one machine steps its own optimizer on shared weights.

The parameters of every local rank are mapped onto one shared-memory file (rank 0's values):
lock-free SGD (Recht et al. 2011), no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from phalanx.comm.group import World
from phalanx.train.strategies.base import Strategy

__all__ = ["Hogwild"]


@dataclass(frozen=True)
class Hogwild(Strategy):
    """Lock-free training on parameters shared by every rank of one machine."""

    name: ClassVar[str] = "hogwild"
    replicas_equal: ClassVar[bool] = False  # each rank steps its own optimizer
    lockstep: ClassVar[bool] = False  # no communication at all

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from phalanx.hogwild.shared import share_parameters

        if world.local_world_size != world.world_size:
            raise ValueError(
                f"strategy='hogwild' shares memory within one machine, but the job has "
                f"world_size={world.world_size} over several nodes (local_world_size="
                f"{world.local_world_size}); use phalanx.PS(mode='async') across machines"
            )
        if world.world_size > 1:
            share_parameters(model)
        return model
