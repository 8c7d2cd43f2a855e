"""``phalanx.LocalSGD(sync_every=H)`` and ``phalanx.DiLoCo(...)``: communicate every H steps.

Each rank steps its own optimizer on its own batches, with no gradient communication; every
``sync_every`` optimizer steps the replicas are averaged (LocalSGD) or DiLoCo's outer optimizer
steps the global parameters with the averaged pseudo-gradient (``phalanx/local_sgd/``). Every
rank starts from rank 0's parameters. A checkpoint keeps each rank's replica and inner
optimizer state (they differ between synchronisations) and the state the ranks share
(DiLoCo's global parameters and outer momentum, the steps since the last synchronisation), so
a resumed job trains on bit-identically at the same world size.

What each rank sent and how long it spent synchronising: ``job.runner.sync.stats``
(:class:`phalanx.local_sgd.SyncStats`); its wait on communication is in ``job.summary()``.

A late replica: ``late_policy="wait"`` (the default: every replica syncs after exactly
``sync_every`` steps, so results are reproducible bit for bit and resumes are exact at any
step) or ``"weighted"`` (a round ends when the first replica has taken ``sync_every`` steps;
each replica joins at its next step and counts by the steps it took, so the others wait at
most one step of the late one per round; ``phalanx/local_sgd/late.py``). With "weighted" the
ranks are not in step: ``job.log`` records each rank's own values, the straggler monitor
compares none, the loop must run no collectives of its own between rounds, and
``job.save()`` is allowed only right after a round (every rank at 0 steps since it; e.g.
when ``job.runner.sync.late.round`` reaches a multiple of k).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import FLAG, check_choice, check_float, check_int, rule
from phalanx.comm.group import World
from phalanx.local_sgd import DiLoCoSync, LocalSGDSync, PeriodicSync, Replica
from phalanx.local_sgd.checkpoint import ReplicaModelState, replica_optimizer_state
from phalanx.local_sgd.late import LATE_POLICIES
from phalanx.local_sgd.outer import Outer, check_momentum
from phalanx.local_sgd.quantise import CODECS
from phalanx.train.precision import Precision
from phalanx.train.strategies.base import (
    JobOptions,
    LossFn,
    Prepared,
    Runner,
    Scheduler,
    Strategy,
    check_fields,
)
from phalanx.train.strategies.initial_state import start_from_rank0
from phalanx.train.strategies.role import Role

__all__ = ["DiLoCo", "LocalSGD", "ReplicaRunner", "ReplicaStrategy", "bucket_bytes"]

_MIB = 1024 * 1024


@dataclass(frozen=True)
class ReplicaStrategy(Strategy, ABC):
    """Replicas that train alone between synchronisations (the base of LocalSGD, DiLoCo)."""

    lockstep: ClassVar[bool] = False  # the ranks communicate every few steps

    @abstractmethod
    def make_sync(self, replica: Replica, group: dist.ProcessGroup | None) -> PeriodicSync:
        """The algorithm that synchronises ``replica`` over ``group``."""

    def late(self) -> str:
        """Its ``late_policy`` ("wait" unless the strategy has one)."""
        return "wait"

    def start(self, world: World, job: JobOptions) -> Runner:
        """Refuse fp16 (each rank's loss scale would skip steps on its own); make the runner."""
        if job.precision == "fp16-mixed":
            raise ValueError(
                f"precision='fp16-mixed' with strategy {self!r}: each replica's gradient scaler "
                f"would skip steps on its own; use precision='bf16-mixed' or 'fp32'"
            )
        return ReplicaRunner(self, world)


def bucket_bytes(cap_mb: float) -> int:
    """``bucket_cap_mb`` in bytes (at least 1)."""
    return max(1, int(cap_mb * _MIB))


@dataclass(frozen=True)
class LocalSGD(ReplicaStrategy):
    """Every rank steps its own optimizer; every ``sync_every`` steps the parameters (and
    floating-point buffers) are averaged over the ranks.

    Args:
        sync_every: Optimizer steps between averages (H >= 1; 1 with plain SGD is DDP).
        bucket_cap_mb: Flat all-reduce buckets of at most this many MiB.
        late_policy: "wait" (every replica averages after exactly ``sync_every`` steps) or
            "weighted" (the first to get there ends the round; the average weighs the steps
            each replica took).
    """

    name: ClassVar[str] = "localsgd"
    sync_every: int = 8
    bucket_cap_mb: float = 25.0
    late_policy: str = "wait"

    def __post_init__(self) -> None:
        check_fields(
            self,
            sync_every=rule(check_int, min=1),
            bucket_cap_mb=rule(check_float, above=0),
            late_policy=rule(check_choice, choices=LATE_POLICIES),
        )

    def make_sync(self, replica: Replica, group: dist.ProcessGroup | None) -> PeriodicSync:
        cap = bucket_bytes(self.bucket_cap_mb)
        return LocalSGDSync(replica, group, self.sync_every, cap, self.late_policy)

    def late(self) -> str:
        return self.late_policy


@dataclass(frozen=True)
class DiLoCo(ReplicaStrategy):
    """DiLoCo (Douillard et al. 2023): ``sync_every`` inner steps of the user's optimizer,
    then an outer SGD step with Nesterov momentum on the averaged pseudo-gradient.

    Args:
        sync_every: Inner steps per outer step (H >= 1; the paper's 500).
        outer_lr: The outer SGD's learning rate (> 0; the paper's 0.7).
        outer_momentum: Its momentum (0 <= momentum < 1; the paper's 0.9).
        nesterov: Nesterov momentum (ignored with outer_momentum=0).
        bucket_cap_mb: Flat all-reduce buckets of at most this many MiB.
        quantise: How pseudo-gradients travel: "fp32", "bf16", "int8" or "int4" (the
            integers with one float32 scale per ``quantise_block`` elements).
        quantise_block: Elements per scale.
        late_policy: "wait" (every replica takes exactly ``sync_every`` inner steps) or
            "weighted" (the first to get there ends the round; the pseudo-gradients are
            weighted by the inner steps each replica took).
    """

    name: ClassVar[str] = "diloco"
    sync_every: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    bucket_cap_mb: float = 25.0
    quantise: str = "fp32"
    quantise_block: int = 256
    late_policy: str = "wait"

    def __post_init__(self) -> None:
        check_fields(
            self,
            sync_every=rule(check_int, min=1),
            outer_lr=rule(check_float, above=0),
            outer_momentum=rule(check_momentum),
            nesterov=FLAG,
            bucket_cap_mb=rule(check_float, above=0),
            quantise=rule(check_choice, choices=CODECS),
            quantise_block=rule(check_int, min=1),
            late_policy=rule(check_choice, choices=LATE_POLICIES),
        )

    def outer(self) -> Outer:
        """The outer step these options describe."""
        return Outer(
            self.outer_lr, self.outer_momentum, self.nesterov, self.quantise, self.quantise_block
        )

    def make_sync(self, replica: Replica, group: dist.ProcessGroup | None) -> PeriodicSync:
        cap = bucket_bytes(self.bucket_cap_mb)
        return DiLoCoSync(replica, group, self.sync_every, self.outer(), cap, self.late_policy)

    def late(self) -> str:
        return self.late_policy


class ReplicaRole(Role):
    """Every rank trains; with ``late_policy="weighted"`` not in step between rounds."""

    def __init__(self, weighted: bool) -> None:
        self.weighted = weighted
        self.sync: PeriodicSync | None = None
        """The runner's algorithm, once set up."""

    def finish(self) -> None:
        """The loop is over: wait for any synchronisation still in flight."""
        if self.sync is not None:
            self.sync.finish()

    def logs_in_step(self) -> bool:
        return not self.weighted

    def peer_sets(self) -> Iterable[list[int]] | None:
        # Weighted: the ranks are not in step; a collective among them would re-couple them.
        return [] if self.weighted else None


class ReplicaRunner(Runner):
    """A :class:`ReplicaStrategy` at work: local steps, then the algorithm's synchronisation."""

    def __init__(self, strategy: ReplicaStrategy, world: World) -> None:
        super().__init__(strategy, world)
        self.options = strategy
        self.sync: PeriodicSync | None = None
        """The algorithm (set by :meth:`setup`); its ``stats`` count syncs, bytes, seconds."""
        self.role: ReplicaRole = ReplicaRole(strategy.late() == "weighted")

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        loss_fn: LossFn | None,
        precision: Precision,
    ) -> Prepared:
        """Start every rank from rank 0's model; the model and optimizer stay the user's."""
        if optimizer is None:
            raise ValueError(
                f"strategy {self.options!r} checkpoints each rank's own optimizer state: pass "
                f"the optimizer to Job.setup(model, optimizer)"
            )
        start_from_rank0(model)
        precision.wrap_forward(model)
        self.model, self.optimizer = model, optimizer
        self.sync = self.role.sync = self.options.make_sync(Replica.of(model), None)
        return Prepared(model, optimizer, optimizer, scheduler, loss_fn)

    def step(self, optimizer: torch.optim.Optimizer | None, precision: Precision) -> bool | None:
        """The local step; every ``sync_every`` steps, the synchronisation."""
        stepped = super().step(optimizer, precision)
        assert self.sync is not None
        self.sync.after_step()
        return stepped

    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        """Per-rank views of the replica and inner optimizer (``local_sgd/checkpoint.py``).

        Raises:
            ValueError: saving with ``late_policy="weighted"`` mid-round (the ranks may be
                at different steps, and only the round boundary is common to all).
        """
        if self.model is None or self.sync is None:
            return None, None
        if saving and self.sync.late is not None and self.sync.steps:
            raise ValueError(
                f"job.save() with late_policy='weighted' {self.sync.steps} steps into round "
                f"{self.sync.late.round}: save right after a round (0 steps since it), which "
                f"every rank reaches together"
            )
        rank, size = self.world.rank, self.world.world_size
        model = ReplicaModelState(self.model, self.sync, rank, size)
        opt = None
        if self.optimizer is not None:
            opt = replica_optimizer_state(self.model, self.optimizer, rank, size)
        # checkpoint.save / load take these sharded views where they take a model / optimizer
        return cast(tuple[nn.Module, torch.optim.Optimizer | None], (model, opt))
