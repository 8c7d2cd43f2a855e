"""Live recovery inside :class:`phalanx.Job`: survivors of a lost rank go on, replacements join.

In a worker of ``phalanx run --recovery live`` (or with ``Job(recovery="live")``) the job's
default group is a :class:`phalanx.recovery.LiveGroup`, ``job.loader`` deals global batches of
``batch_size x`` the launcher's world size with a :class:`phalanx.data.ElasticSampler`, and the
job's own collectives are guarded. The training loop does not change:

* **The loader runs the loop.** ``job.loader``'s batch sampler (:class:`LiveBatches`) is asked
  for each step's indices when the training loop asks for its next batch, so ``for x, y in
  loader`` and ``for x, y in job.progress(loader)`` take the same path (:meth:`LiveTraining.deal`):
  a step boundary, then the step planned at the membership it settled. A loader made again
  (each epoch) goes on from the previous one's place. The loader deals one step at a time, so it
  takes no DataLoader workers (they would read ahead of the loop: refused, naming the fix).
* **A failed step is redone.** When a collective of ``job.backward`` / ``job.step`` raises
  because a peer died (gloo raises within about 0.1 s; a hung peer times out), this member
  drops the step's gradients, agrees with the other survivors on the next generation
  (``LiveGroup.recover``), and ``job.step`` returns False. The loader then hands out the
  same global batch again, re-split over the new membership, and each member's loss is scaled so
  that the average is still the global batch's mean (``StepPlan.mean_scale``).
* **No committed step is lost.** A survivor may have completed the failed step (its all-reduce
  finished before the peer died; the failure surfaced at its next collective). After every
  membership change the members bring everyone to the highest committed step
  (:func:`.live_state.exchange`): whoever is behind receives the state, over the network.
* **The set-up is covered too.** A member lost in ``Job.setup``'s broadcast of rank 0's model
  (DDP) is recovered from like one lost in a step: the survivors regroup, the exchange hands the
  start to those the broadcast did not reach, and the replacement joins at the first boundary.
* **Replacements join at a step boundary.** Before each step, every member takes part in one
  ``LiveGroup.admit``. A replacement's ``Job.setup`` joins the exchange that follows its
  admission and receives the model, optimizer, scheduler, sampler, ledger, RNG and tracked
  objects from a live member; nothing is read from disk.
* **One collective order.** After any change every member's next collective is the boundary's
  admit, so a survivor that noticed the failure in its backward and one that noticed it at the
  next step's boundary meet there. ``job.log`` and ``job.save`` after a failed step skip their
  communication (the step holds nothing new).
* **Every sample exactly once per epoch**: each commit records the whole step's sample ids
  (every rank's) in :attr:`LiveTraining.ledger`, handed to newcomers with the state.
* **ZeRO** (:mod:`.live_zero`): the sharded state comes back from the members' memory (each
  mirrors a neighbour's shards), at the newest step all shards are held at: the job may roll
  back a step, and then trains it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from phalanx.checkpoint.sync import set_peer_check
from phalanx.comm import group as pg
from phalanx.comm.env import discover_env
from phalanx.data.elastic_plan import StepPlan
from phalanx.data.elastic_sampler import ElasticSampler
from phalanx.data.ledger import SampleLedger
from phalanx.data_parallel.module_state import broadcast_coalesced
from phalanx.recovery import JobFinished, LiveGroup, RecoveryError
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.train.job_data import LoaderArgs
from phalanx.train.live_rules import (
    MAX_IDLE_RECOVERIES,
    Regroup,
    generation_world,
    is_peer_failure,
    live_recovery,
    live_strategy,
)
from phalanx.train.live_shards import ShardGrads, owned_shards
from phalanx.train.live_state import Held, exchange
from phalanx.train.live_zero import LiveShards
from phalanx.train.strategies.base import LossFn, Runner, Scheduler, Strategy
from phalanx.train.strategies.zero import Zero
from phalanx.train.train_state import TrainState

if TYPE_CHECKING:  # annotations only
    from phalanx.train.job_checkpoint import Checkpoints

__all__ = [
    "MAX_IDLE_RECOVERIES",
    "LiveBatches",
    "LiveTraining",
    "Regroup",
    "is_peer_failure",
    "live_recovery",
]

log = logging.getLogger(__name__)


class LiveTraining:
    """The live-recovery side of one :class:`phalanx.Job` (``job.live``).

    Args:
        group: The job's :class:`~phalanx.recovery.LiveGroup`.
        launch_world_size: The launcher's world size: the global batch is ``batch_size`` times
            it, whatever the membership.
        exact: Reduce ``launch_world_size`` shards in a fixed order (:mod:`.live_shards`).
    """

    def __init__(self, group: LiveGroup, launch_world_size: int, exact: bool = False) -> None:
        self.group = group
        self.launch_world_size = launch_world_size
        self.exact = exact
        self.held = Held()
        self.grads = ShardGrads()  # exact: this step's shard gradients so far
        self._micro = 0  # index of the shard in training among this member's
        self._step_calls = 0  # job.step() calls so far: the loader deals after each
        self._idle = (-1, 0)  # (step, recoveries in a row at it that lost nobody)
        self.regroups: list[Regroup] = []
        """Every membership change this member went through, in order."""
        self.failed = False
        """The step in progress failed: its gradients are dropped and it is redone."""
        self.plan: StepPlan | None = None
        """The step in progress (its global batch and this membership's split)."""
        self.zero: LiveShards | None = None
        """ZeRO's shard mirrors and restores (:mod:`.live_zero`); None under DDP."""
        self._started = True
        """This member's state is the job's common start (False on a first member until the
        set-up's broadcast of rank 0's model, or an exchange, reached it)."""
        self._runner: Runner | None = None
        self._state: TrainState | None = None
        self._checkpoints: Checkpoints | None = None

    def bind(self, runner: Runner, state: TrainState, checkpoints: Checkpoints | None) -> None:
        """Train ``runner`` (the strategy's) on ``state`` (the job's); ``checkpoints`` (the
        job's) load the newest checkpoint when ZeRO's shards are in no member's memory."""
        self._runner, self._state, self._checkpoints = runner, state, checkpoints

    @property
    def runner(self) -> Runner:
        """The strategy's runner this live job trains (:meth:`bind`)."""
        assert self._runner is not None, "LiveTraining.bind() comes first"
        return self._runner

    @property
    def state(self) -> TrainState:
        """The job's training state, which the members exchange (:meth:`bind`)."""
        assert self._state is not None, "LiveTraining.bind() comes first"
        return self._state

    @property
    def step(self) -> int:
        """Optimizer steps committed."""
        return self.state.step

    @classmethod
    def start(cls, exact: bool = False) -> LiveTraining:
        """Join the live job this process was started for (``phalanx run --recovery live``).

        A replacement that arrives after the others finished exits with success (status 0):
        there is no training left for it, and the launcher counts the slot as finished.
        """
        if dist.is_initialized():
            raise ValueError(
                "Job(recovery='live') builds the default process group itself (a "
                "phalanx.recovery.LiveGroup); do not call init_process_group() before it"
            )
        try:
            made = cls(LiveGroup.from_env("gloo"), discover_env().world_size, exact)
        except JobFinished as exc:
            log.warning("%s", exc)
            raise SystemExit(0) from exc
        set_peer_check(made.group.check_peers)  # a checkpoint's store waits see deaths
        return made

    def close(self) -> None:
        """Leave the job (``Job.close``): no more peer checks, the group closed."""
        if self.zero is not None:
            self.zero.close()
        set_peer_check(None)
        self.group.close()
        pg.adopt_world(None)

    @property
    def ledger(self) -> SampleLedger | None:
        """Sample ids of every committed step (None until ``job.loader`` is called)."""
        return self.held.ledger

    def world(self, before: pg.World | None = None) -> pg.World:
        """The current generation's :class:`phalanx.World` (also ``phalanx.world()``)."""
        made = generation_world(self.group.rank, self.group.world_size, before)
        pg.adopt_world(made)
        return made

    # ---- set-up ------------------------------------------------------------------------------
    def strategy(self, chosen: Strategy) -> Strategy:
        """The strategy this live job runs (``live_rules.live_strategy``)."""
        if isinstance(chosen, Zero):
            self.zero = LiveShards(chosen.mirror_every)
        return live_strategy(chosen, self.group.joined)

    def after_setup(self, scheduler: Scheduler | None) -> None:
        """The first generation takes rank 0's model; a replacement receives the state
        (``scheduler``'s among it: the one ``setup`` returned).

        Under DDP the broadcast of rank 0's model is guarded like a step's collectives: when a
        member is lost in it, the survivors regroup, and the exchange that settles the new
        generation hands the start (rank 0's model, or the first survivor's when rank 0 was
        lost before its broadcast reached anyone) to every member it did not reach."""
        self.state.scheduler = scheduler
        model = self.runner.model
        assert model is not None
        if self.zero is not None and isinstance(model, FullyShardedDataParallel):
            model.register_forward_pre_hook(self.zero.check_forward)
        if self.group.joined:  # a replacement admitted into the running job
            self._regroup("joined", time.monotonic())
            return
        if self.zero is not None:  # its constructors broadcast rank 0's parameters already
            self._common_start(model)
            self.zero.start(self.runner, self.state, self.group, self.held)
            return
        # A member lost in the broadcast: the survivors regroup, and the exchange hands the
        # start to those it did not reach (the replacement joins at a step boundary).
        self._started = self.group.rank == 0  # the root holds the start it sends
        self.guard(lambda: self._common_start(model))
        self.failed = False  # no step is open: the first one is planned at the boundary

    def _common_start(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters (but ZeRO's, which its constructors broadcast) and buffers (but
        ZeRO-3's) to every member of the first generation."""
        tensors = [] if self.zero is not None else [p.detach() for p in model.parameters()]
        if not isinstance(model, FullyShardedDataParallel):
            tensors += list(model.buffers())
        broadcast_coalesced(tensors, 0, None)
        self._started = True
        if self.group.rank in self.group.newcomers:  # it took a dead first process's place
            self.group.state_received()

    def _shard_count(self) -> int:
        return self.launch_world_size if self.exact else self.group.world_size

    def owned(self) -> list[int]:
        """The shards this member trains in each step at the current membership."""
        return owned_shards(self._shard_count(), self.group.world_size, self.group.rank)

    def loader(self, args: LoaderArgs, loaded: dict[str, Any] | None) -> DataLoader[Any]:
        """``job.loader``'s loader: global batches of ``batch_size x`` the launch world size,
        each member's shards of each step (the job's sampler is the ElasticSampler).
        ``loaded``: a sampler state a resume loaded before any loader existed.

        A loader made again (inside the epoch loop) goes on from the previous one's place: the
        sampler's position is the job's, committed step by committed step.

        Raises:
            ValueError: the job's loader already deals another dataset or global batch (an
                evaluation loader needs ``eval=True``).
        """
        made = ElasticSampler(
            args.dataset,
            args.batch_size * self.launch_world_size,
            self._shard_count(),
            self.owned()[0],
            shuffle=True if args.shuffle is None else args.shuffle,
            seed=args.seed,
            drop_last=args.drop_last,
        )
        state = self.state
        if isinstance(state.sampler, ElasticSampler):
            _go_on(state.sampler, made)
        elif loaded is not None:
            made.load_state_dict(loaded)
        state.sampler = made
        self.held.settle(state)
        if self.zero is not None:
            self.zero.sampler_built(made.state_dict())
        if self.held.ledger is None:
            self.held.ledger = SampleLedger.for_sampler(made)
        batches = LiveBatches(self, made)
        return DataLoader(args.dataset, batch_sampler=batches, **args.kwargs)  # type: ignore[arg-type]

    # ---- the loop ----------------------------------------------------------------------------
    def deal(self, sampler: ElasticSampler) -> Iterator[list[int]]:
        """The live loop, run each time the training loop asks the loader for a batch: a
        boundary before each step (admissions; a failed step's generation settled), then the
        indices of each shard this member trains in the step, planned at the membership just
        settled. Ends when the job's epoch has no step left (its last step committed, or a
        state received at a boundary ended it).

        The boundary comes before the end is checked: a member whose last step of the epoch
        committed meets there one whose step failed, and both leave the epoch together, with no
        step open (``failed`` is False: what follows the epoch, ``job.log`` or ``job.save``,
        communicates on every member).

        Raises:
            ValueError: a loader replaced by a newer ``job.loader(...)``; a batch asked for
                before ``job.step()`` ran for the one handed out (DataLoader workers read
                ahead, or the loop skipped ``job.step()``).
        """
        state = self.state
        if sampler is not state.sampler:
            raise ValueError(
                "Job(recovery='live'): this loader was replaced by a newer job.loader(...) "
                "call; iterate the newest one (a live job has one training loader, whose place "
                "each new one takes over)"
            )
        if not state.epochs_driven:  # no Job.epochs(): a new pass reads the next epoch
            state.epoch = max(state.epoch, sampler.epoch)
        while True:
            self.boundary()
            plan, self.failed = sampler.plan(), False  # every change is settled: no step is open
            if plan is None or sampler.epoch > state.epoch:
                self.plan = None
                return
            self.plan = plan
            for micro, shard in enumerate(self.owned()):
                self._micro, calls = micro, self._step_calls
                yield sampler.indices(plan, shard)
                if self._step_calls == calls:
                    raise ValueError(_READ_AHEAD)
                if self.failed:
                    break

    def boundary(self) -> None:
        """Admit waiting replacements (every member calls it before every step)."""
        if self.zero is not None:
            self.zero.at_boundary(self.state, self.held)
        started = time.monotonic()
        while True:
            try:
                if not self.group.admit(self._quiesce):
                    return
            except Exception as exc:
                self._recover(exc)
                self._regroup("lost", started)
                continue
            self._regroup("joined", started)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of one shard: its mean loss scaled so that the average over shards is
        the global batch's mean; plain: DDP reduces, exact: the last shard reduces them all."""
        if self.failed:
            return
        shard = self.owned()[self._micro]
        scale = 1.0 if self.plan is None else self.plan.mean_scale(shard)
        scaled = loss if scale == 1.0 else loss * scale
        if not self.exact:
            self.guard(lambda: self.state.precision.backward(scaled))
            return
        self.state.precision.backward(scaled)  # no communication: DDP's sync is off
        params = self._params()
        self.grads.stash(params)
        if self._micro + 1 == len(self.owned()):
            shards, size = self._shard_count(), self.group.world_size
            self.guard(lambda: self.grads.reduce(params, shards, size))

    def forward_backward(
        self,
        inputs: object,
        targets: object,
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """``job.forward_backward``, guarded (ZeRO-3's forward communicates); a failed step's
        loss is NaN (the step is redone)."""
        loss: list[torch.Tensor] = []
        runner = self.runner
        with LiveShards.forwarding(self.zero):
            self.guard(
                lambda: loss.append(runner.forward_backward(inputs, targets, loss_fn, backward))
            )
        return loss[0] if loss and not self.failed else torch.full((), float("nan"))

    def step_optimizer(self, optimizer: torch.optim.Optimizer | None) -> bool | None:
        """``job.step``'s optimizer step: None when it does not step now (between shards, or
        the step failed: its gradients are dropped and the loader redoes it); else whether
        the job's scheduler steps too. A stepped step is committed.

        Raises:
            ValueError: no batch of ``job.loader(...)``'s loader is in training (another
                loader's, or ``job.step()`` called twice for one batch).
        """
        if self.plan is None:
            raise ValueError(
                "Job(recovery='live'): job.step() without a batch of job.loader(...)'s loader "
                "in training; a live job steps once per batch of the loader job.loader(...) "
                "returned (iterated directly or through job.progress)"
            )
        self._step_calls += 1
        if self.exact and not self.failed and self._micro + 1 < len(self.owned()):
            return None
        stepped: list[bool] = []
        runner, precision = self.runner, self.state.precision
        if self.guard(self.sync_buffers) and self.guard(
            lambda: stepped.append(bool(runner.step(optimizer, precision)))
        ):
            self.commit()
            return stepped[0]
        self.grads.clear()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        return None

    def after_step(self) -> bool:
        """The step is counted: ZeRO refreshes its neighbour's copy when due. False when that
        found a member lost (the job then rolled back to a step all shards are held at)."""
        zero = self.zero
        return zero is None or self.guard(lambda: zero.after_step(self.state, self.held))

    def _params(self) -> list[torch.Tensor]:
        model = self.runner.model
        return [] if model is None else [p for p in model.parameters() if p.requires_grad]

    def guard(self, what: Callable[[], object]) -> bool:
        """Run ``what`` (a step's communication); False after a peer failure (now recovered)."""
        if self.failed:
            return False
        started = time.monotonic()
        try:
            what()
            return True
        except Exception as exc:
            self._recover(exc)
            self._regroup("lost", started)
            return False

    def sync_buffers(self) -> None:
        """Rank 0's buffers to everyone (what DDP's forward would have broadcast)."""
        model = self.runner.model
        buffers = [] if model is None else list(model.buffers())
        if buffers:
            broadcast_coalesced(buffers, 0, None)

    def commit(self) -> None:
        """The step committed: move the sampler on and record every rank's samples."""
        sampler, plan = self.state.sampler, self.plan
        assert isinstance(sampler, ElasticSampler) and plan is not None
        sampler.commit(plan)
        if self.held.ledger is not None:
            for r in range(plan.num_replicas):
                self.held.ledger.record(plan.step, plan.epoch, r, sampler.indices(plan, r))
        self.plan = None

    def resumed(self, ledger: dict[str, object] | None) -> None:
        """The job resumed from a checkpoint: the ledger saved with it goes on."""
        if ledger is not None:
            self.held.ledger = SampleLedger.from_dict(ledger)

    # ---- membership changes ------------------------------------------------------------------
    def _recover(self, exc: Exception) -> None:
        """Form the next generation after ``exc``, or raise it: when no peer failed (a bug of
        this rank), or when the same step keeps failing with nobody lost (the failure is not a
        lost member's: ``MAX_IDLE_RECOVERIES`` in a row)."""
        if not is_peer_failure(exc) or isinstance(exc, RecoveryError):
            raise exc
        before = self.group.members
        self._quiesce()
        self.group.recover(exc)
        idle = self.group.members == before
        step, count = self._idle
        now = self.state.step
        self._idle = (now, count + 1 if idle and step == now else int(idle))
        if self._idle[1] >= MAX_IDLE_RECOVERIES:
            raise RecoveryError(
                f"live recovery: step {now} failed {self._idle[1]} times in a row "
                f"although no member was lost (rank {self.group.rank}, generation "
                f"{self.group.generation}); the last error: {exc}"
            ) from exc

    def _quiesce(self) -> None:
        """Before the group is torn down: end the traffic on it (ZeRO's mirror exchange)."""
        if self.zero is not None:
            self.zero.settle()

    def _settle(self) -> tuple[int, list[int]] | None:
        """The new generation's state: ZeRO's shards restored (and its next mirror), everyone
        at the highest committed step; the strategy's objects on the new group."""
        stateful = self.group.rank not in self.group.newcomers
        runner, state = self.runner, self.state
        if self.zero is None:
            moved = exchange(runner, state, stateful, self.held, started=self._started)
            self._started = True  # whoever lacked the start received it
            runner.regroup()
            return moved
        self.zero.restore(runner, state, self.group, self.held, self._checkpoints)
        moved = exchange(runner, state, stateful, self.held, sharded=True)
        self.zero.start(runner, state, self.group, self.held)
        return moved

    def _regroup(self, kind: str, started: float) -> None:
        """Settle a new generation: worlds, the committed step, the model's group, the sampler."""
        self.failed = True
        runner, state = self.runner, self.state
        while True:
            runner.world = self.world(runner.world)
            try:
                moved = self._settle()
            except Exception as exc:
                self._recover(exc)
                continue
            break
        if moved is not None and self.group.rank in moved[1]:
            self.group.state_received()
        if runner.optimizer is not None:
            runner.optimizer.zero_grad(set_to_none=True)
        self.grads.clear()
        if isinstance(state.sampler, ElasticSampler):
            state.sampler.set_membership(self._shard_count(), self.owned()[0])
        event = Regroup(
            kind,
            self.group.generation,
            self.group.world_size,
            state.step,
            time.monotonic() - started,
            None if moved is None else moved[0],
        )
        self.regroups.append(event)
        event.log()


_READ_AHEAD = (
    "Job(recovery='live'): the loader was asked for another batch before job.step() ran for "
    "the one it handed out. A live job's loader deals each step after the previous one "
    "committed or failed (a lost member's step is redone, re-split), so call job.step() after "
    "every batch, and make the loader with num_workers=0 (DataLoader workers read ahead)"
)


def _go_on(previous: ElasticSampler, made: ElasticSampler) -> None:
    """``made`` (a new loader's sampler) takes over ``previous``'s place in the epochs."""
    try:
        made.load_state_dict(previous.state_dict())
    except ValueError as exc:
        raise ValueError(
            f"Job.loader(...): a live job has one training loader, and its new loader must deal "
            f"the same data to go on from the previous one's place ({exc}); make evaluation "
            f"loaders with eval=True"
        ) from None


class LiveBatches(Sampler[list[int]]):
    """``job.loader``'s batch sampler in a live job: iterating it runs the live loop.

    A DataLoader without workers asks its batch sampler for the next indices when the training
    loop asks for the next batch, so :meth:`LiveTraining.deal` runs each step's boundary there,
    for ``for batch in loader`` and ``job.progress(loader)`` alike.

    Args:
        live: The job's live side.
        sampler: The job's :class:`ElasticSampler` when the loader was made.
    """

    def __init__(self, live: LiveTraining, sampler: ElasticSampler) -> None:
        self.live, self.sampler = live, sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.live.deal(self.sampler)

    def __len__(self) -> int:
        """Micro-batches left in the sampler's epoch at the current membership."""
        return len(self.sampler) * len(self.live.owned())
