"""How a :class:`phalanx.Job` joins its job: the group it makes, finds, or the live one.

Three cases, decided once here so that ``Job`` does not branch on them later:

- a process group exists already (``init_process_group`` before ``Job()``): the job uses it and
  leaves it to its owner;
- none exists: the job makes it from the launcher's environment and destroys it on ``close()``;
- live recovery (``recovery="live"``, or ``phalanx run --recovery live``): the job joins the live
  group (:class:`.live.LiveTraining`), which its runner wrapper closes
  (:class:`.live_runner.LiveRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.comm import group as pg
from phalanx.comm.group import World
from phalanx.train.job_checkpoint import Checkpoints
from phalanx.train.live import LiveTraining
from phalanx.train.live_rules import check_strategy, live_recovery
from phalanx.train.live_runner import LiveRunner, LiveSaves
from phalanx.train.save_policy import SavePolicy
from phalanx.train.strategies.base import Runner, Strategy
from phalanx.train.train_state import TrainState

__all__ = ["Start", "start"]


@dataclass(frozen=True)
class Start:
    """A job's place in its process group, and what it owns there."""

    strategy: Strategy
    """The strategy to run (live recovery's form of it)."""
    world: World
    owns_group: bool
    """The job made the default group and destroys it on ``close()``."""
    live: LiveTraining | None
    """Live recovery at work, else None."""

    def saves(self) -> SavePolicy:
        """How the job's checkpoints run: in the background, or live recovery's way."""
        return SavePolicy() if self.live is None else LiveSaves(self.live)

    def wrap(self, runner: Runner, state: TrainState, checkpoints: Checkpoints) -> Runner:
        """The runner the job calls: ``runner`` itself, or live recovery's wrapper of it
        (which exchanges ``state`` between the members)."""
        if self.live is None:
            return runner
        return LiveRunner(runner, self.live, state, checkpoints)


def start(recovery: str | None, strategy: Strategy, grad_accum: int, backend: str | None) -> Start:
    """Join the job: check live recovery's rules first, then make or find the group."""
    mode = live_recovery(recovery)
    if mode is not None:
        check_strategy(strategy, grad_accum, mode == "live-exact")
        live = LiveTraining.start(mode == "live-exact")
        return Start(live.strategy(strategy), live.world(), False, live)
    if pg.is_initialized():
        return Start(strategy, pg.world(), False, None)
    return Start(strategy, pg.init_process_group(backend), True, None)
