"""Uneven inputs for ZeRO-1/2: :class:`~torch.distributed.algorithms.join.Join` support.

A rank that runs out of inputs must still take part in the others' per-step collectives (the
reduce-scatter of stages 1/2 and the all-gather of every step). Inside ``Join([...,
optimizer])`` the join hook shadows ``step()`` on such a rank, so no rank waits forever. With
``stage=None`` it steps with the gradients it has (those DDP's join hook, or another hook before
this one, set), as torch's does; with stages 1/2 it contributes zero gradients to the average
(which stays divided by the world size, as DDP's ``join(divide_by_initial_world_size=True)``).

A rank that still has inputs notifies the context once per iteration, before its first
collective (the first reduce-scatter during backward in stage 2, otherwise ``step``), as
``Join`` requires of every joinable.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

__all__ = ["JoinableZero"]


class _ShadowStep(JoinHook):
    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """One step of a rank that has joined: the collectives, without notifying."""
        if self.zero.stage is not None:  # it averages the gradients: this rank adds zeros
            self.zero.zero_grad(set_to_none=True)
        self.zero._step(None, {}, notify=False)


class JoinableZero(Joinable):
    """The :class:`Joinable` half of :class:`~phalanx.sharding.ZeroRedundancyOptimizer`."""

    params: list[torch.Tensor]
    process_group: dist.ProcessGroup | None
    _notified: bool

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A hook that shadows ``step()`` on a rank that has run out of inputs."""
        return _ShadowStep(self)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join`` puts its own all-reduce tensors (the parameters' device)."""
        return self.params[0].device

    @property
    def join_process_group(self) -> Any:
        """The group of the optimizer's collectives (the world by default)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _notify(self) -> None:
        """Tell a :class:`Join` context, once per iteration, before the first collective."""
        if not self._notified:
            self._notified = True
            Join.notify_join_context(self)
