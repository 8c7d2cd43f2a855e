"""``phalanx.Zero(stage=1|2|3, shard="world"|"host")``: ZeRO sharding of optimizer state,
gradients, parameters.

Stages 1 and 2 keep the model whole and rebuild the optimizer as a
``phalanx.ZeroRedundancyOptimizer`` (same class, parameter groups and options); stage 3 wraps
the model in ``phalanx.FullyShardedDataParallel`` (each ``ModuleList`` element, or each
top-level child, a unit) and rebuilds the optimizer over the shards.

``shard="host"`` (hybrid sharding, :mod:`phalanx.sharding.hybrid`): :meth:`Zero.start` builds
each host's shard group and the replicate groups across hosts, and its runner
(:class:`ZeroRunner`) hands them to the same wrapper and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from weakref import WeakKeyDictionary

import torch
from torch import nn

from phalanx._check import FLAG, check_choice, check_float, check_int, rule
from phalanx.comm.group import World
from phalanx.data_parallel.module_state import broadcast_coalesced
from phalanx.sharding.hybrid import SHARD_CHOICES, HybridGroups, make_hybrid_groups
from phalanx.train.grad_scaler import GradShards
from phalanx.train.strategies.base import JobOptions, Runner, Strategy, SyncOwner, check_fields
from phalanx.train.strategies.optimizers import (
    accepted,
    options,
    rebuild_one_group,
    unit_policy,
)

__all__ = ["Zero", "ZeroRunner"]

DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Zero(Strategy):
    """ZeRO (Rajbhandari et al. 2020) of stage 1 (optimizer state), 2 (+ gradients) or 3
    (+ parameters).

    Args:
        stage: 1, 2 or 3.
        bucket_cap_mb: Gradient bucket size of stages 1 and 2, in MiB.
        init_sync: Broadcast rank 0's parameters when the model and optimizer are built
            (default); live recovery turns it off for a replacement, which receives the state
            after it joins (``train/live_zero.py``).
        mirror_every: Under live recovery (``Job(recovery="live")``), refresh the copy of
            this rank's shards that its neighbour keeps in memory after every this many steps
            (default 1: every step). A larger value costs less and may roll a recovery back
            by up to ``mirror_every - 1`` steps, which are trained again. Ignored otherwise.
        shard: ``"world"`` (default): shard over every rank. ``"host"``: hybrid sharding
            (HSDP; DeepSpeed's hpZ): shard over the ranks of each host, on shared memory
            (CPU) or NCCL, and replicate across hosts, each gradient shard all-reduced there
            (gloo on CPU); the gradient still averages over every rank. Hosts are the
            launcher's nodes (``phalanx.world().node_rank``), each with the same number of
            ranks. Not with live recovery.
    """

    name: ClassVar[str] = "zero"
    rebuilds_optimizer: ClassVar[bool] = True
    stage: int = 1
    bucket_cap_mb: float = DEFAULT_BUCKET_MB
    init_sync: bool = True
    mirror_every: int = 1
    shard: str = "world"

    def __post_init__(self) -> None:
        check_fields(
            self,
            stage=rule(check_int, min=1, max=3),
            bucket_cap_mb=rule(check_float, above=0),
            init_sync=FLAG,
            mirror_every=rule(check_int, min=1),
            shard=rule(check_choice, choices=SHARD_CHOICES),
        )
        if self.stage == 3 and self.bucket_cap_mb != DEFAULT_BUCKET_MB:
            raise ValueError(
                f"Zero(bucket_cap_mb={self.bucket_cap_mb}) applies to stages 1 and 2; stage 3 "
                f"communicates per unit (drop bucket_cap_mb)"
            )

    def start(self, world: World, job: JobOptions) -> Runner:
        """Under ``shard="host"``, build the hosts' groups (collective); else the plain runner."""
        if self.shard == "world":
            return Runner(self, world)
        return ZeroRunner(self, world, make_hybrid_groups(world))

    def wrap(self, model: nn.Module, world: World, hybrid: HybridGroups | None = None) -> nn.Module:
        if self.stage < 3:
            if world.world_size > 1 and any(True for _ in model.buffers()):
                _BUFFER_SYNCS[model] = BufferSync(model, now=self.init_sync)
            return model
        from phalanx.sharding.zero3 import FullyShardedDataParallel

        units = unit_policy(model)
        return FullyShardedDataParallel(
            model,
            wrap=lambda m: m in units,
            sync_module_states=self.init_sync,
            process_group=None if hybrid is None else hybrid.shard,
            replicate_group=None if hybrid is None else hybrid.replicate,
        )

    def shard_optimizer(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        world: World,
        hybrid: HybridGroups | None = None,
    ) -> torch.optim.Optimizer:
        if self.stage == 3:
            from phalanx.sharding.zero import check_elementwise

            check_elementwise(type(optimizer))
            return rebuild_one_group(optimizer, model.parameters(), "zero3")
        from phalanx.sharding import ZeroRedundancyOptimizer

        groups = [{**options(g), "params": g["params"]} for g in optimizer.param_groups]
        sharded = ZeroRedundancyOptimizer(
            groups,
            type(optimizer),
            parameters_as_bucket_view=True,
            stage=self.stage,
            bucket_cap_mb=self.bucket_cap_mb,
            broadcast_params=self.init_sync,
            process_group=None if hybrid is None else hybrid.shard,
            replicate_group=None if hybrid is None else hybrid.replicate,
            **accepted(type(optimizer), optimizer.defaults),
        )
        if model in _BUFFER_SYNCS:
            _BUFFER_SYNCS[model].owner = sharded
        return sharded

    def clip_grad_norm_(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """Over every rank's shard: ZeRO-3's flat shards, or ZeRO-1/2's optimizer ranges."""
        from phalanx.sharding import ZeroRedundancyOptimizer
        from phalanx.sharding.zero3 import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return model.clip_grad_norm_(max_norm, norm_type)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def grad_shards(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> GradShards | None:
        """fp16: each rank unscales what it steps (ZeRO-1/2's reduced ranges, ZeRO-3's flat
        shards) and the ranks agree on overflows (``strategies/zero_scaling.py``)."""
        from phalanx.train.strategies.zero_scaling import zero_grad_shards

        return zero_grad_shards(model, optimizer)

    def sync_owners(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> list[SyncOwner]:
        from phalanx.sharding import ZeroRedundancyOptimizer
        from phalanx.sharding.zero3 import FullyShardedDataParallel

        owners: list[SyncOwner] = []
        if isinstance(model, FullyShardedDataParallel):
            owners.append(model)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            owners.append(optimizer)
        return owners


class ZeroRunner(Runner):
    """A hybrid-sharded ZeRO job (``Zero(shard="host")``): the default runner, with the
    hosts' groups handed to the wrapper and the optimizer."""

    def __init__(self, strategy: Zero, world: World, hybrid: HybridGroups) -> None:
        super().__init__(strategy, world)
        self.zero = strategy
        self.hybrid = hybrid
        """This rank's shard group (its host) and replicate group (its peers across hosts)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        return self.zero.wrap(model, self.world, self.hybrid)

    def shard_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        return self.zero.shard_optimizer(model, optimizer, self.world, self.hybrid)


class BufferSync:
    """Stages 1 and 2 keep ``model``'s buffers rank 0's by DDP's rule, which they would have
    under DDP: broadcast at start-up (``init_sync``), then before a forward whenever the forward
    before it trained and synchronised its gradients (every forward without accumulation; the
    first micro-step of each window with it). Batch-norm statistics then equal DDP's. The
    model stays unwrapped (the optimizer broadcasts the parameters), so a forward pre-hook
    does it, over the default group of the moment (the whole job)."""

    def __init__(self, model: nn.Module, now: bool) -> None:
        self.next = True
        self.owner: SyncOwner | None = None
        """The ZeRO optimizer, whose ``require_backward_grad_sync`` says whether the coming
        backward synchronises (set once it exists: :meth:`Zero.shard_optimizer`)."""
        if now:
            self._broadcast(model)
        model.register_forward_pre_hook(self._before_forward)

    @staticmethod
    def _broadcast(model: nn.Module) -> None:
        broadcast_coalesced([b.detach() for b in model.buffers()], 0, None)

    def _before_forward(self, module: nn.Module, args: object) -> None:
        if self.next:
            self._broadcast(module)
        syncs = self.owner is None or self.owner.require_backward_grad_sync
        self.next = torch.is_grad_enabled() and syncs


_BUFFER_SYNCS: WeakKeyDictionary[nn.Module, BufferSync] = WeakKeyDictionary()
"""Each stage 1/2 model's buffer sync, for :meth:`Zero.shard_optimizer` to hand it its owner."""
