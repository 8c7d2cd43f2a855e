"""The non-finite step guard: a step whose gradients hold an inf or NaN on any rank is skipped on
every rank (``Job(skip_nonfinite=True)``).

fp16 has its scaler for this (it skips the step and backs the scale off). In bf16 and fp32 a
single bad batch (a loss spike, a division by zero in user code) would otherwise write NaN into
every parameter of every rank, and training is lost from there. With the guard, before each
optimizer step every rank checks the gradients it is about to apply (its own shard under ZeRO,
its stage's under a pipeline), the ranks agree in one small all-reduce (which ranks found one),
and if any did, every rank drops the step's gradients, skips the optimizer and scheduler step,
and rank 0 says so. The step still counts (its batches were consumed). torchtitan and
Megatron-LM skip such steps the same way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from phalanx.comm.group import World
from phalanx.train.grad_scaler import GradShards
from phalanx.train.precision import Precision

if TYPE_CHECKING:
    from phalanx.train.job_start import Start
    from phalanx.train.strategies.base import Runner, Strategy

__all__ = ["NonFiniteGuard", "guard_for"]

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """Checks each step's gradients; see the module's docstring.

    Args:
        world: This process's place in the job (all of its ranks agree).
        enabled: False: it checks nothing (``Job(skip_nonfinite=False)``).
    """

    def __init__(self, world: World, enabled: bool = True) -> None:
        self.world = world
        self.enabled = enabled
        self.count = 0
        """Steps skipped so far."""

    def bad_ranks(self, optimizer: torch.optim.Optimizer, shards: GradShards | None) -> list[int]:
        """The ranks whose gradients for this step hold an inf or NaN (every rank gets the same
        list; collective when the job has several ranks)."""
        holder = optimizer
        if shards is not None:
            if shards.ready is not None:
                shards.ready()
            holder = shards.holder
        grads = [p.grad for g in holder.param_groups for p in g["params"] if p.grad is not None]
        local = (
            any(not bool(torch.isfinite(n)) for n in torch._foreach_norm(grads)) if grads else False
        )
        if self.world.world_size == 1:
            return [self.world.rank] if local else []
        flags = torch.zeros(self.world.world_size, device=self.world.device)
        flags[self.world.rank] = float(local)
        dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def skipped(self, optimizer: torch.optim.Optimizer | None, runner: Runner, step: int) -> bool:
        """Check step ``step``'s gradients; True (and them dropped) when a rank's hold one."""
        if not self.enabled or optimizer is None:
            return False
        bad = self.bad_ranks(optimizer, runner.grad_shards(optimizer))
        if bad:
            self.skip(optimizer, step, bad)
        return bool(bad)

    def skip(self, optimizer: torch.optim.Optimizer, step: int, ranks: list[int]) -> None:
        """Drop the step's gradients and say so (rank 0)."""
        optimizer.zero_grad(set_to_none=True)
        self.count += 1
        if self.world.is_main:
            log.warning(
                "step %d skipped: non-finite gradients (inf or NaN) on rank(s) %s; every rank "
                "dropped its gradients and kept its parameters (%d skipped so far)",
                step,
                ", ".join(map(str, ranks)),
                self.count,
            )


def guard_for(
    on: bool, world: World, precision: Precision, joined: Start, strategy: Strategy
) -> NonFiniteGuard:
    """The job's guard (``Job(skip_nonfinite=on)``; one that checks nothing when off).

    Raises:
        ValueError: where it cannot work, naming why.
    """
    if not on:
        return NonFiniteGuard(world, enabled=False)
    why = None
    if precision.scaler is not None:
        why = "fp16's loss scaler already skips steps with non-finite gradients"
    elif joined.live is not None:
        why = "live recovery changes the ranks the guard agrees over"
    elif not strategy.lockstep:
        why = f"the ranks of {strategy.name!r} do not step together"
    if why is not None:
        raise ValueError(f"Job(skip_nonfinite=True): {why}; leave skip_nonfinite off")
    return NonFiniteGuard(world)
