"""ZeRO in a live job: the members' memory is the checkpoint of the sharded state.

Under ``Job(recovery="live")`` with ``phalanx.Zero(stage=1|2|3)`` each member holds only its
shard of the optimizer state (ZeRO-3: of the parameters too), so a lost member takes its shard
with it. :class:`LiveShards` keeps a :class:`~phalanx.recovery.ShardMirror` over each
generation: every member holds its right neighbour's shards, refreshed in the background after
every ``every``-th step. Beside each of its own snapshots it keeps the rest of the job's state
at that step (sampler, scheduler, RNG, tracked objects, buffers: :func:`.live_state.collect`
without the sharded parts), so that the job can roll back to a snapshot's step.

After every membership change each member calls :meth:`LiveShards.restore`:

1. the members all-gather which snapshots they hold and pick the newest step at which every
   old member's shards are held (:func:`phalanx.recovery.restore_shards`); with nobody lost (a
   replacement admitted) each first snapshots the current step, so no step is lost;
2. the same ZeRO objects are re-sharded in place over the new group and filled with that
   step's state (:meth:`phalanx.recovery.RestoredShards.regroup`): no checkpoint is read;
3. a member ahead of that step rolls the rest of its state back to it, its sample ledger too
   (the steps after it are trained again, on the new membership).

The caller then hands newcomers the rest of the state (:func:`.live_state.exchange`) and calls
:meth:`LiveShards.start` for the new generation's mirror. Two adjacent members lost at once
leave a shard in nobody's memory (:class:`phalanx.recovery.ShardsLost`): the members then load
the job's newest checkpoint, in-process and at the new world size, and the log says so; a job
without one raises.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from phalanx.checkpoint.catalog import latest
from phalanx.recovery import (
    LiveGroup,
    Member,
    RecoveryError,
    ShardMirror,
    ShardsLost,
    restore_shards,
)
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.train.live_state import Held, apply, collect
from phalanx.train.strategies.base import Runner
from phalanx.train.train_state import TrainState

if TYPE_CHECKING:  # annotations only
    from phalanx.train.job_checkpoint import Checkpoints

__all__ = ["LiveShards"]

log = logging.getLogger(__name__)


class LiveShards:
    """The sharded side of one live ZeRO job (``job.live.zero``).

    Args:
        every: Refresh the neighbour's copy after every this many steps (an int >= 1). A
            larger value costs less and may roll a recovery back by up to ``every - 1`` steps.
    """

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.mirror: ShardMirror | None = None
        """This generation's mirror (None until :meth:`start`: a newcomer holds no shards)."""
        self.members: tuple[Member, ...] = ()
        """The generation the mirror spans, in its rank order (its old ranks after a change)."""
        self.states: dict[int, dict[str, object]] = {}
        """The job's unsharded state at each step this member holds a snapshot of."""
        self.due: int | None = None
        """A step whose shards were snapshotted and whose unsharded state is taken at the
        next boundary, once the training loop's own code for that step has run (a tracked
        counter bumped after ``job.step()`` belongs to that step)."""
        self.in_forward_backward = False
        """Inside ``job.forward_backward``, which redoes a failed forward (ZeRO-3's gathers)."""
        self.runner: Runner | None = None
        """The strategy's runner whose shards are mirrored (set by :meth:`start`)."""

    @staticmethod
    @contextlib.contextmanager
    def forwarding(shards: LiveShards | None) -> Iterator[None]:
        """``job.forward_backward`` in progress (for :meth:`check_forward`)."""
        if shards is None:
            yield
            return
        shards.in_forward_backward = True
        try:
            yield
        finally:
            shards.in_forward_backward = False

    def check_forward(self, module: torch.nn.Module, args: object) -> None:
        """A forward pre-hook of a live ZeRO-3 model: refuse training forwards the job cannot
        redo when a member is lost (outside ``job.forward_backward``)."""
        if module.training and not self.in_forward_backward:
            raise ValueError(
                "Job(recovery='live') with phalanx.Zero(stage=3): train with "
                "loss = job.forward_backward(inputs, targets), not model(inputs): ZeRO-3's "
                "forward gathers parameters from every member, and only the job can redo it "
                "when a member is lost (evaluation in model.eval() may call the model)"
            )

    @staticmethod
    def objects(runner: Runner) -> tuple[torch.optim.Optimizer, FullyShardedDataParallel | None]:
        """The job's ZeRO optimizer, and its ZeRO-3 model (None under ZeRO-1/2)."""
        model, optimizer = runner.model, runner.optimizer
        if optimizer is None:
            raise ValueError(
                "Job(recovery='live') with phalanx.Zero: pass an optimizer to job.setup(); "
                "the live job restores its shards"
            )
        return optimizer, model if isinstance(model, FullyShardedDataParallel) else None

    def start(self, runner: Runner, state: TrainState, group: LiveGroup, held: Held) -> None:
        """A mirror over the current generation, refreshed at once (collective: it makes its
        exchange group over the current default group)."""
        self.settle()
        optimizer, model = self.objects(runner)
        self.mirror = ShardMirror(optimizer, model, every=self.every, timeout=group.timeout)
        self.members, self.states = group.members, {}
        self.runner = runner
        self._refresh(state, held)

    def sampler_built(self, state: dict[str, object]) -> None:
        """``job.loader`` made the sampler (``state``: its state): the snapshots taken before,
        when no step had been committed yet, roll back to its start."""
        for kept in self.states.values():
            if kept["sampler"] is None:
                kept["sampler"] = copy.deepcopy(state)

    def after_step(self, state: TrainState, held: Held) -> None:
        """After a committed step: refresh the shards' copy when due (the rest of the state is
        kept at the next :meth:`at_boundary`). Raises a failed exchange's error (a lost peer),
        as a collective would."""
        if self.mirror is not None and state.step % self.every == 0:
            self.mirror.refresh(state.step)
            self.due = state.step

    def at_boundary(self, state: TrainState, held: Held) -> None:
        """Before the next step: keep the job's unsharded state of the step refreshed last."""
        if self.due == state.step:
            self._keep(state, held)
        self.due = None

    def _refresh(self, state: TrainState, held: Held) -> None:
        assert self.mirror is not None
        self.mirror.refresh(state.step)
        self._keep(state, held)

    def _keep(self, state: TrainState, held: Held) -> None:
        assert self.mirror is not None and self.runner is not None
        self.states[state.step] = _unsharded(self.runner, state, held)
        kept = {s.step for s in self.mirror.own}
        self.states = {step: s for step, s in self.states.items() if step in kept}
        self.due = None

    def settle(self) -> None:
        """Before the generation's groups are torn down: end the mirror's exchange
        (:meth:`ShardMirror.close`: what arrived is kept, a lost peer's error is not raised,
        and a peer waiting on this member's part fails at once)."""
        if self.mirror is not None:
            self.mirror.close()

    def close(self) -> None:
        """The job ends: join the exchange in flight, drop the snapshots."""
        self.settle()
        self.mirror, self.states = None, {}

    def restore(
        self,
        runner: Runner,
        state: TrainState,
        group: LiveGroup,
        held: Held,
        checkpoints: Checkpoints | None,
    ) -> int:
        """Re-shard the job's ZeRO objects over the current generation and fill them from the
        members' memory; roll this member back to that step. Returns the step.

        Collective over the new default group: every member calls it, newcomers too. When two
        adjacent members were lost, ``checkpoints`` (the job's) loads the newest checkpoint.

        Raises:
            ShardsLost: two adjacent members were lost (their shards are in nobody's memory)
                and the job has no checkpoint.
        """
        mirror = self.mirror
        lost: list[int] = []
        if mirror is not None:
            lost = [r for r, m in enumerate(self.members) if m not in group.members]
            if not lost:
                mirror.take(state.step)
                if state.step not in self.states:
                    self.states[state.step] = _unsharded(runner, state, held)
        optimizer, model = self.objects(runner)
        try:
            restored = restore_shards(mirror, lost, None)
        except ShardsLost as exc:  # every member sees the same reports: all are here
            return _from_checkpoint(runner, state, checkpoints, exc)
        restored.regroup(optimizer, model)
        if mirror is not None and state.step != restored.step:
            self._roll_back(runner, state, held, restored.step)
        return restored.step

    def _roll_back(self, runner: Runner, state: TrainState, held: Held, step: int) -> None:
        kept = self.states.get(step)
        if kept is None:
            raise RecoveryError(
                f"live recovery: the shards were restored at step {step}, but this member "
                f"(at step {state.step}) kept the job's state of steps "
                f"{sorted(self.states)} only"
            )
        ledger = held.ledger
        apply(runner, state, copy.deepcopy(kept), held)
        held.ledger = ledger
        sampler = kept["sampler"]
        if ledger is not None and isinstance(sampler, dict):
            ledger.forget_from(int(sampler["epoch"]), int(sampler["step"]))


def _unsharded(runner: Runner, state: TrainState, held: Held) -> dict[str, object]:
    """A copy of the job's state but the shards and the ledger (rolled back by forgetting)."""
    kept = Held(sampler=held.sampler, tracked=held.tracked)
    return copy.deepcopy(collect(runner, state, kept, sharded=True))


def _from_checkpoint(
    runner: Runner, state: TrainState, checkpoints: Checkpoints | None, lost: ShardsLost
) -> int:
    """Re-shard the ZeRO objects over the new group and load the job's newest checkpoint into
    everything (collective); returns its step."""
    folder = None if checkpoints is None else checkpoints.directory
    newest = None if folder is None else latest(folder)
    if newest is None:
        raise ShardsLost(
            f"{lost}; the job has no checkpoint to fall back to (checkpoint_dir={folder!r})"
        ) from lost
    log.warning("live recovery: %s; loading the newest checkpoint %s instead", lost, newest)
    assert checkpoints is not None
    optimizer, model = LiveShards.objects(runner)
    if model is None:
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        optimizer.regroup(None)
    else:  # placeholders of the right shapes: the checkpoint overwrites them
        full = {k: torch.zeros(shape) for k, shape in model.full_shapes().items()}
        model.regroup(None, {**full, **dict(model.module.named_buffers())}, optimizer=optimizer)
    checkpoints.load_newest()
    return state.step
