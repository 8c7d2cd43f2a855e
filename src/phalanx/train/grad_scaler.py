"""The fp16 gradient scaler of a job: torch's ``GradScaler``, checking the gradients each rank
actually steps, with every rank agreeing on an overflow.

torch's ``GradScaler.step(optimizer)`` unscales ``optimizer``'s gradients and skips the step if
one of them is inf or NaN (Micikevicius et al., "Mixed Precision Training", 2018, §3.2). Two
things break that when ranks hold different gradients:

- **Where the gradients are.** ZeRO-2 frees the full gradients during backward; the rank steps
  its reduced ranges (the inner optimizer's tensors, ``sharding/owned.py``), which the
  optimizer's ``param_groups`` do not show: the scaler would find nothing to unscale.
- **Agreement.** Ranks that hold different gradients (ZeRO-1/2's ranges, ZeRO-3's flat shards,
  a mesh's tensor shards, torch FSDP's DTensors) can disagree: one finds an inf and skips while
  another steps, and the replicas and their scales diverge from then on.

:class:`AgreedGradScaler` takes, per optimizer, a :class:`GradShards` route: which optimizer's
``param_groups`` hold this rank's gradients (made ready first: a reduction, collective), and
whether the ranks must agree, over which group. The found-inf flag is then all-reduced with MAX,
so every rank skips the same steps and its scale stays equal to the others' (torch's FSDP
``ShardedGradScaler`` does the same for its shards). Data-parallel replicas whose gradients are
already averaged (DDP) need no route: their flags agree by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c

__all__ = ["AgreedGradScaler", "GradShards"]


@dataclass(frozen=True)
class GradShards:
    """Where an optimizer's gradients are on this rank, for the fp16 scaler."""

    holder: torch.optim.Optimizer
    """The optimizer whose ``param_groups`` hold, as ``.grad``, what this rank steps (ZeRO-1/2:
    the inner optimizer over its ranges; otherwise the optimizer itself)."""
    agree: bool = False
    """True where ranks hold different gradients: the found-inf flag is all-reduced (MAX)."""
    group: dist.ProcessGroup | None = None
    """The ranks that must agree (None: every rank)."""
    ready: Callable[[], object] | None = None
    """Called before unscaling to put the gradients in place (ZeRO-1/2's reduce-scatter;
    collective, and a no-op once done for this step)."""


class AgreedGradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` (same options, state and checkpoints) that unscales and checks
    the gradients a :class:`GradShards` route names, agreeing on overflows over its group.

    An optimizer without a route is handled exactly as torch's scaler handles it.
    """

    def __init__(self, device: str = "cuda", **options: float | int | bool) -> None:
        super().__init__(device, **options)  # type: ignore[arg-type]
        self._routes: dict[int, GradShards] = {}

    def route(self, optimizer: torch.optim.Optimizer, shards: GradShards | None) -> None:
        """Unscale ``optimizer``'s gradients where ``shards`` says (None: its own, unagreed)."""
        if shards is None:
            self._routes.pop(id(optimizer), None)
        else:
            self._routes[id(optimizer)] = shards

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # The one hook torch's own ShardedGradScaler overrides too: unscale_() and the
        # optimizer-side inf check both come through here, so step() and update() see the
        # agreed flag (keyed by the outer optimizer: its step() is what is skipped).
        shards = self._routes.get(id(optimizer))
        if shards is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if shards.ready is not None:
            shards.ready()
        found = super()._unscale_grads_(shards.holder, inv_scale, found_inf, allow_fp16)
        if not shards.agree:
            return found if found else {found_inf.device: found_inf}
        return {found_inf.device: agree_found_inf(found, found_inf, shards.group)}


def agree_found_inf(
    found: dict[torch.device, torch.Tensor], like: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """One flag, > 0 where any rank of ``group`` found an inf/NaN on any device. Collective:
    every rank calls it once per step, even one with no gradient at all."""
    flag = torch.zeros_like(like)
    for value in found.values():
        flag.add_(value.to(flag.device))
    c.all_reduce(flag, dist.ReduceOp.MAX, group=group)
    return flag
