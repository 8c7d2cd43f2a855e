"""Live recovery as a runner: the strategy's runner, wrapped.

A live job (``Job(recovery="live")``) calls the same :class:`~.strategies.base.Runner` protocol
as any other. :class:`LiveRunner` wraps the strategy's runner and routes the calls that
communicate through :class:`.live.LiveTraining`, which guards them, redoes a failed step, admits
replacements and hands them the state. ``Job`` itself does not know it runs live. The wrapper
comes with its own:

- :class:`LiveRole`: metrics are averaged only when the step in progress did not fail; no
  straggler monitor (its asynchronous gathers would outlive a group);
- :class:`LiveSaves`, the job's save policy (``job_start.py`` picks it): saves are written in
  line (a background write would outlive a lost member's group), guarded (abandoned when a
  member is lost meanwhile: the job goes on), record the elastic sampler and carry the sample
  ledger; no SIGTERM preemption (live recovery survives lost members instead).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint import rng
from phalanx.comm.group import World
from phalanx.data.elastic_sampler import ElasticSampler
from phalanx.train.grad_scaler import GradShards
from phalanx.train.job_checkpoint import Checkpoints
from phalanx.train.job_data import LoaderArgs
from phalanx.train.live import LiveTraining
from phalanx.train.precision import Precision
from phalanx.train.resume_point import REPLAY_NOW, Record, ResumePoint
from phalanx.train.save_policy import SavePolicy
from phalanx.train.strategies.base import LossFn, Prepared, Runner, Scheduler
from phalanx.train.strategies.role import Role
from phalanx.train.train_state import TrainState

__all__ = ["LiveRole", "LiveRunner", "LiveSaves"]

log = logging.getLogger(__name__)


class LiveRole(Role):
    """Every member trains in step, except in a step that failed (its collectives are gone)."""

    def __init__(self, live: LiveTraining) -> None:
        self.live = live

    def logs_in_step(self) -> bool:
        return not self.live.failed

    def peer_sets(self) -> list[list[int]]:
        return []  # no straggler monitor: its gathers would outlive a group


class LiveSaves(SavePolicy):
    """Saves written in line, guarded, with the elastic sampler and the sample ledger."""

    background = False
    preemptible = False

    def __init__(self, live: LiveTraining) -> None:
        self.live = live

    def record(self, point: ResumePoint, state: TrainState) -> Record:
        sampler = state.sampler
        if not isinstance(sampler, ElasticSampler):  # no loader yet: the epoch redone whole
            return Record(state.epoch, True, None, rng.capture(), REPLAY_NOW)
        done = sampler.epoch > state.epoch  # the epoch's last step committed
        return Record(state.epoch, done, sampler.state_dict(), rng.capture(), REPLAY_NOW)

    def commit(self, write: Callable[[], object]) -> bool:
        live = self.live
        if live.failed:
            log.warning("Job.save() after a failed step: nothing new to save (step %d)", live.step)
            return False
        if not live.guard(write):
            log.warning("checkpoint of step %d abandoned: a member was lost in it", live.step)
            return False
        return True

    def extra(self) -> dict[str, Any]:
        ledger = self.live.ledger
        return {"ledger": None if ledger is None else ledger.to_dict()}

    def resumed(self, extra: dict[str, Any]) -> None:
        self.live.resumed(extra.get("ledger"))

    def received(self, name: str) -> dict[str, Any] | None:
        return self.live.held.tracked.pop(name, None)


class LiveRunner(Runner):
    """The strategy's runner ``inner``, its communication guarded by ``live``.

    Args:
        inner: The strategy's runner.
        live: The job's live recovery.
        state: The job's training state, which the members exchange.
        checkpoints: The job's checkpoints (ZeRO falls back to the newest one).
    """

    def __init__(
        self, inner: Runner, live: LiveTraining, state: TrainState, checkpoints: Checkpoints
    ) -> None:
        self.inner, self.live = inner, live
        self.strategy = inner.strategy
        self.groups = inner.groups
        self.role = LiveRole(live)
        live.bind(inner, state, checkpoints)

    # The inner runner's attributes, read and written through (a regroup changes the world).
    @property
    def world(self) -> World:
        return self.inner.world

    @world.setter
    def world(self, value: World) -> None:
        self.inner.world = value

    @property
    def model(self) -> nn.Module | None:
        return self.inner.model

    @model.setter
    def model(self, value: nn.Module | None) -> None:
        self.inner.model = value

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.inner.optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer | None) -> None:
        self.inner.optimizer = value

    @property
    def comm_measured(self) -> bool:
        return self.inner.comm_measured

    @comm_measured.setter
    def comm_measured(self, value: bool) -> None:
        self.inner.comm_measured = value

    # ---- set-up --------------------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        loss_fn: LossFn | None,
        precision: Precision,
    ) -> Prepared:
        """The strategy's set-up, then the first generation's common start (rank 0's model) or
        a replacement's state, received from a member."""
        made = self.inner.setup(model, optimizer, scheduler, loss_fn, precision)
        self.live.after_setup(made.scheduler)
        return made

    def attach_phases(self, enter: Callable[[str | None], None]) -> None:
        self.inner.attach_phases(enter)

    # ---- the loop ------------------------------------------------------------------------------
    def loader(
        self, args: LoaderArgs, state: TrainState, point: ResumePoint
    ) -> torch.utils.data.DataLoader[Any]:
        """Global batches of ``batch_size x`` the launch world size, dealt step by step."""
        return self.live.loader(args, point.take_loaded())

    def data_shard(self) -> tuple[int, int]:
        return self.inner.data_shard()

    def replica_group(self) -> dist.ProcessGroup | None:
        return self.inner.replica_group()

    def require_backward_grad_sync(self, sync: bool) -> None:
        # live-exact reduces the shards itself, after the last one.
        self.inner.require_backward_grad_sync(sync and not self.live.exact)

    def forward_backward(
        self,
        inputs: object,
        targets: object,
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        return self.live.forward_backward(inputs, targets, loss_fn, backward)

    def backward(self, loss: torch.Tensor, precision: Precision, grad_accum: int) -> None:
        self.live.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer | None, precision: Precision) -> bool | None:
        return self.live.step_optimizer(optimizer)

    def after_step(self) -> bool:
        return self.live.after_step()

    def grad_shards(self, optimizer: torch.optim.Optimizer) -> GradShards | None:
        return self.inner.grad_shards(optimizer)

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.inner.clip_grad_norm_(max_norm, norm_type)

    def regroup(self) -> None:
        self.inner.regroup()

    def check_schedule(self, schedule: str) -> None:
        self.inner.check_schedule(schedule)

    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        return self.inner.checkpointed(saving)

    def close(self) -> None:
        self.live.close()
        self.inner.close()
