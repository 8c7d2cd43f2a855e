"""The strategy protocol: what :class:`phalanx.Job` asks of a way to train on many ranks.

A strategy comes in two parts, as Lightning Fabric's ``Strategy`` does without its plugins:

- :class:`Strategy`, the *options* (a frozen dataclass, checked when built, reusable by any
  number of jobs): ``phalanx.DDP()``, ``phalanx.Zero(stage=2)``, ``phalanx.Mesh(pp=2)``...
- :class:`Runner`, one job's strategy *at work*, made by :meth:`Strategy.start` once the
  process group exists. ``Job`` calls only the methods declared here, never probing the wrapped
  model or optimizer for attributes.

The default runner covers the data-parallel family: it wraps the model
(:meth:`Strategy.wrap`), may rebuild the optimizer (:meth:`Strategy.shard_optimizer`), turns
gradient sync on and off through torch's ``require_backward_grad_sync`` on the objects the
strategy names (:meth:`Strategy.sync_owners`), and every rank reads its own shard of the data.
A pipeline or a parameter server subclasses :class:`Runner`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from phalanx._fields import check_fields
from phalanx.comm.group import World
from phalanx.mesh.groups import ParallelGroups
from phalanx.train.grad_scaler import GradShards
from phalanx.train.job_data import LoaderArgs, training_loader
from phalanx.train.loop_helpers import repoint
from phalanx.train.precision import Precision
from phalanx.train.resume_point import ResumePoint
from phalanx.train.strategies.role import Role
from phalanx.train.train_state import Stateful, TrainState

__all__ = [
    "JobOptions",
    "LossFn",
    "Prepared",
    "Runner",
    "Scheduler",
    "Stateful",
    "Strategy",
    "SyncOwner",
    "check_fields",
]

LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, targets) -> loss``."""

Scheduler = LRScheduler
"""A learning-rate scheduler (``ReduceLROnPlateau`` included: it is one in torch >= 2.2)."""


class SyncOwner(Protocol):
    """What holds torch's "sync this backward" flag: DDP and FSDP models, ZeRO-2 optimizers."""

    require_backward_grad_sync: bool


@dataclass(frozen=True)
class Prepared:
    """What :meth:`Runner.setup` made of the user's objects."""

    model: nn.Module
    """The model the user trains (wrapped)."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer handed back to the user."""
    stepped: torch.optim.Optimizer | None
    """The optimizer the job steps (None where the strategy steps it, e.g. on servers)."""
    scheduler: Scheduler | None
    """The scheduler the job steps after each optimizer step (None: the strategy does)."""
    loss_fn: LossFn | None
    """The loss :meth:`phalanx.Job.forward_backward` uses."""


@dataclass(frozen=True)
class JobOptions:
    """The job-wide options a strategy may refuse (a parameter server does not checkpoint)."""

    precision: str = "fp32"
    grad_accum: int = 1
    checkpoint_dir: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class Strategy:
    """A way to train one model on many ranks: its options, and how to start it.

    Subclasses are frozen dataclasses that check their fields in ``__post_init__`` and set
    :attr:`name`. The data-parallel family overrides :meth:`wrap` (and
    :meth:`shard_optimizer`, :meth:`sync_owners`); others override :meth:`start`.
    """

    name: ClassVar[str] = "custom"
    """A short name of the family for messages ("ddp", "zero", "mesh", "ps"...); the preset
    names (``Job("zero2")``) are kept in ``registry.py``."""

    rebuilds_optimizer: ClassVar[bool] = False
    """True where :meth:`shard_optimizer` rebuilds the user's optimizer (ZeRO, FSDP)."""

    comm_measured: ClassVar[bool] = True
    """False where this strategy's communication wait cannot be timed (said once, not 0)."""

    lockstep: ClassVar[bool] = True
    """Every optimizer step ends in a collective every rank joins, so no rank gets a step
    ahead of another (what SIGTERM's agreed stop relies on: ``train/preemption.py``); False
    where ranks step on their own (parameter servers, Hogwild, local SGD)."""

    replicas_equal: ClassVar[bool] = True
    """Whether the model and optimizer state a checkpoint sees as replicated (not sharded
    views) is equal on every rank, so that every rank may write a share of it
    (``checkpoint.save(replicas_equal=...)``); False where each rank's differs (Hogwild)."""

    def start(self, world: World, job: JobOptions) -> Runner:
        """Check the options against the world and the job; make this job's runner.

        Collective where the strategy makes process groups: every rank calls it in turn.
        Raises ``ValueError`` naming the option, the value and the world size.
        """
        return Runner(self, world)

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        """The model as this strategy trains it (already on ``world.device``)."""
        return model

    def shard_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> torch.optim.Optimizer:
        """The optimizer rebuilt in this strategy's form (where :attr:`rebuilds_optimizer`)."""
        return optimizer

    def sync_owners(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> list[SyncOwner]:
        """The objects whose ``require_backward_grad_sync`` the job sets before each forward."""
        return []

    def measure_comm(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Install communication-wait timing on torch's own objects; False if it cannot."""
        return self.comm_measured

    def clip_grad_norm_(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """Clip the gradients by the whole model's norm; return that norm (as torch's).

        The default suits strategies whose every rank holds whole, synchronised gradients
        (DDP after its backward, one process, Hogwild's own); sharding strategies override it.
        """
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def regroup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Bind ``model`` / ``optimizer`` to the current default group, which live recovery
        replaced (``train/live.py``); the default: nothing holds a group."""

    def grad_shards(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World
    ) -> GradShards | None:
        """Where fp16's scaler finds the gradients ``optimizer`` steps on this rank, and who
        must agree on an overflow (``train/grad_scaler.py``). The default, None: the
        optimizer's own gradients, equal on every rank (DDP's after its all-reduce)."""
        return None


class Runner:
    """One job's strategy at work: the protocol :class:`phalanx.Job` calls.

    Its :attr:`role` says whether and with whom this rank trains (``strategies/role.py``);
    :attr:`groups` are a ``phalanx.Mesh``'s process groups (None for the others). Live
    recovery wraps a runner in one of its own (``train/live_runner.py``).

    Args:
        strategy: The options it runs.
        world: This process's place in the job.
    """

    def __init__(self, strategy: Strategy, world: World) -> None:
        self.strategy = strategy
        self.world = world
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._owners: list[SyncOwner] = []
        self.groups: ParallelGroups | None = None
        self.role = Role()
        """Whether and with whom this rank trains (parameter servers have their own)."""
        self.comm_measured = strategy.comm_measured
        """Whether :attr:`phalanx.Job.summary`'s ``comm_share`` is measured (else NaN)."""

    # ---- set-up --------------------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        loss_fn: LossFn | None,
        precision: Precision,
    ) -> Prepared:
        """Wrap ``model`` (on this rank's device); rebuild ``optimizer`` if the strategy shards it,
        re-pointing ``scheduler`` at the rebuild."""
        s = self.strategy
        wrapped = self.wrap(model)
        if optimizer is None and s.rebuilds_optimizer:
            raise ValueError(
                f"strategy={s!r} rebuilds the optimizer in its sharded form: "
                f"pass it to Job.setup(model, optimizer)"
            )
        if optimizer is not None and s.rebuilds_optimizer:
            optimizer = self.shard_optimizer(wrapped, optimizer)
            if scheduler is not None:
                repoint(scheduler, optimizer)
        precision.wrap_forward(wrapped)
        self.model, self.optimizer = wrapped, optimizer
        self._owners = s.sync_owners(wrapped, optimizer)
        self.comm_measured = s.measure_comm(wrapped, optimizer)
        return Prepared(wrapped, optimizer, optimizer, scheduler, loss_fn)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the strategy trains it (:meth:`Strategy.wrap`; a runner that made
        process groups of its own passes them)."""
        return self.strategy.wrap(model, self.world)

    def shard_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """The optimizer rebuilt in the strategy's form (:meth:`Strategy.shard_optimizer`)."""
        return self.strategy.shard_optimizer(model, optimizer, self.world)

    def attach_phases(self, enter: Callable[[str | None], None]) -> None:
        """Let the strategy mark phases finer than the job can (a pipeline, per action)."""

    # ---- the loop ------------------------------------------------------------------------------
    def require_backward_grad_sync(self, sync: bool) -> None:
        """Whether the coming backward communicates (set before each micro-step's forward)."""
        for owner in self._owners:
            owner.require_backward_grad_sync = sync

    def loader(
        self, args: LoaderArgs, state: TrainState, point: ResumePoint
    ) -> torch.utils.data.DataLoader[Any]:
        """The job's training loader over this rank's shard (``job.loader(...)``)."""
        return training_loader(args, *self.data_shard(), state, point)

    def data_shard(self) -> tuple[int, int]:
        """(replicas, this rank's replica): ranks of one replica read the same samples."""
        return self.world.world_size, self.world.rank

    def replica_group(self) -> dist.ProcessGroup | None:
        """The group of one rank per replica that includes this rank (None: every rank), in
        replica order: what ``Job.gather`` gathers over. Not collective (made beforehand)."""
        return None

    def forward_backward(
        self,
        inputs: object,
        targets: object,
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and its ``backward``; the loss, detached."""
        assert self.model is not None
        loss = loss_fn(self.model(inputs), targets)
        backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor, precision: Precision, grad_accum: int) -> None:
        """The backward of one micro-step's ``loss`` (averaged over ``grad_accum``)."""
        precision.backward(loss / grad_accum if grad_accum > 1 else loss)

    def step(self, optimizer: torch.optim.Optimizer | None, precision: Precision) -> bool | None:
        """Step at the end of an accumulation window; True when the job's scheduler steps too,
        None when the step did not happen and its batch is trained again (live recovery)."""
        if optimizer is None:
            raise ValueError("Job.step(): no optimizer given and none passed to setup()")
        precision.step(optimizer, self.grad_shards(optimizer))
        optimizer.zero_grad(set_to_none=True)
        return True

    def grad_shards(self, optimizer: torch.optim.Optimizer) -> GradShards | None:
        """Where fp16's scaler finds ``optimizer``'s gradients on this rank, and over which
        ranks overflows are agreed (None: its own gradients, whole and equal everywhere)."""
        if self.model is None:
            return None
        return self.strategy.grad_shards(self.model, optimizer, self.world)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the (unscaled, synchronised) gradients by the whole model's ``norm_type``-norm,
        over every rank's part of it; return that norm. Collective where parameters are split."""
        assert self.model is not None
        return self.strategy.clip_grad_norm_(self.model, self.optimizer, max_norm, norm_type)

    def after_step(self) -> bool:
        """The step is counted (``state.step``); False when it was rolled back since."""
        return True

    def close(self) -> None:
        """The job closes (``Job.close``): release what the runner holds."""

    def regroup(self) -> None:
        """After live recovery replaced the default group: rebind the strategy's objects."""
        if self.model is not None:
            self.strategy.regroup(self.model, self.optimizer)

    def check_schedule(self, schedule: str) -> None:
        """Refuse a learning-rate ``schedule`` ("step", "epoch", "manual") this strategy
        cannot honour (``ValueError`` naming both)."""

    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        """The model and optimizer as checkpoints see them (``saving``: about to be saved)."""
        return self.model, self.optimizer
