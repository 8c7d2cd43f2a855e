"""``phalanx.Job``: a whole distributed training job in a few calls.

    job = phalanx.Job(phalanx.DDP(), precision="bf16-mixed", grad_accum=4, checkpoint_dir="ckpt")
    model, optimizer = job.setup(model, optimizer, scheduler)  # stepped with the optimizer
    loader = job.loader(dataset, batch_size=64, shuffle=True)
    job.track("stats", stats)                     # any state_dict() object, checkpointed
    for epoch in job.epochs(10):                  # resumes from the newest checkpoint
        for x, y in job.progress(loader):         # tqdm on rank 0
            job.backward(loss_fn(model(x), y))    # syncs only on the last micro-step
            job.clip_grad_norm_(1.0)              # unscaled, over every rank's shard
            job.step()                            # the optimizer given to setup()
        job.log(loss=...)                         # averaged over ranks
        job.save()

The traps this avoids: a forgotten ``set_epoch`` (the loader's sampler is set every epoch), saving
``model`` instead of ``model.module`` (checkpoints unwrap), rank-0 saves that time out the other
ranks, uneven data that hangs the last batch (``even_batches``), and gradient accumulation that
synchronises on every micro-step (``no_sync`` until the last one).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn

from phalanx.activation_checkpointing import ActivationCheckpointing, checkpoint_activations
from phalanx.comm import group as pg
from phalanx.comm.group import World
from phalanx.data.elastic_sampler import ElasticSampler
from phalanx.data.eval import EvalLoader
from phalanx.data.sampler import DistributedSampler
from phalanx.train import job_start, observers
from phalanx.train.gather import Number, gather
from phalanx.train.job_args import check_clip, check_epochs, check_job_args, check_slow_down
from phalanx.train.job_checkpoint import Checkpoints
from phalanx.train.job_data import DATA_SEED, LoaderArgs, batch_for, eval_loader
from phalanx.train.job_phases import JobPhases
from phalanx.train.job_reports import JobReports
from phalanx.train.live import LiveTraining
from phalanx.train.loop_helpers import (
    Timer,
    batch_len,
    batches_left,
    configure_logging,
    seed_everything,
    to_device,
)
from phalanx.train.lr_schedule import check_schedule
from phalanx.train.metrics import MetricsLogger
from phalanx.train.nonfinite import guard_for
from phalanx.train.observers import JobView
from phalanx.train.precision import Precision
from phalanx.train.preemption import EXIT_STATUS, Preemption
from phalanx.train.profiling import profile
from phalanx.train.resume_point import LoopHooks, ResumableLoader, ResumePoint
from phalanx.train.slowdown import Slowdown
from phalanx.train.straggler_rule import StragglerRule
from phalanx.train.strategies import JobOptions, Runner, Strategy, resolve
from phalanx.train.strategies.base import LossFn, Scheduler, Stateful
from phalanx.train.strategies.registry import overridden
from phalanx.train.train_state import TrainState

__all__ = ["DATA_SEED", "Job"]


log = logging.getLogger(__name__)


class Job(JobReports):
    """One distributed training job: process group, strategy, data, steps, metrics, checkpoints.

    Args:
        strategy: A strategy (``phalanx.DDP()``, ``phalanx.Zero(stage=2)``,
            ``phalanx.Mesh(pp=2, micro_batches=4)``, ``phalanx.PS(mode="ssp", staleness=2)``,
            ...) or a preset name ("ddp", "zero2", "pipeline", ...; ``strategy_names()``).
            ``PHALANX_STRATEGY`` in the environment (a name or a call such as ``Mesh(tp=2)``)
            replaces it, saying so: how ``phalanx verify`` runs a script under another.
        precision: "fp32", "bf16-mixed" (autocast), "fp16-mixed" (autocast and a gradient
            scaler: ``job.precision.configure_scaler``) or "bf16-true" (the model, its
            gradients and optimizer state in bf16), CPU and GPU alike (``phalanx.precisions``).
        grad_accum: Micro-steps per optimizer step; gradients sync only on the last one.
        seed: None (the default) touches no random generator; an int seeds torch, numpy and
            random on every rank and is the loaders' shuffle seed (see :data:`DATA_SEED` for
            None, and for the strategies that need equal builds on every rank).
        checkpoint_dir: Where :meth:`save` writes and :meth:`epochs` resumes from.
        keep_last: Committed checkpoints to keep.
        metrics_file: JSONL file for :meth:`log` (default ``checkpoint_dir/metrics.jsonl``).
        tensorboard_dir: Also write metrics to TensorBoard (``pip install 'phalanx[tensorboard]'``).
        profile_dir: Write a torch.profiler trace per rank here (Perfetto / chrome://tracing).
        timeline_dir: Record every rank's phases, waits, collectives and point-to-point
            operations, with clock offsets to rank 0, into this folder (``phalanx timeline DIR``
            merges them into one trace with each step's critical path; ``phalanx run
            --timeline DIR`` sets it for every job of a script: :mod:`phalanx.diagnostics`).
        backend: c10d backend when the job initialises the process group.
        straggler_check_every: Every this many steps the ranks gather their per-step compute
            per phase (one small asynchronous all-gather; 0 disables); a rank standing out in
            one phase for several steps is named, with the phase, in the log, the metrics and
            :attr:`straggler_finding` (see ``train/straggler_rule.py``).
        straggler_rule: The detector's margins and persistence (``phalanx.train.StragglerRule``).
        recovery: "live": survive lost ranks in-process and admit replacements (DDP or
            ZeRO-1/2/3, ``grad_accum=1``: :mod:`phalanx.train.live`); "live-exact": the same
            for DDP, bit-identical to a fault-free run (:mod:`phalanx.train.live_shards`);
            "restart": a lost rank ends the job's processes (the launcher restarts them from
            the newest checkpoint); None: what the launcher was told (``--recovery``).
        save_on_sigterm: With a ``checkpoint_dir``, a SIGTERM (a scheduler's preemption) makes
            the ranks agree on a step, save it and exit with status 143
            (:mod:`phalanx.train.preemption`); False keeps SIGTERM's default action.
        skip_nonfinite: Before each optimizer step, check every rank's gradients for inf and
            NaN and skip the step on every rank when any holds one, saying so
            (:mod:`phalanx.train.nonfinite`; bf16 and fp32: fp16's scaler does it already).
            Off by default: it costs a pass over the gradients and one small all-reduce per
            step.
        activation_checkpointing: "full", "selective" or a
            :class:`phalanx.ActivationCheckpointing`: the model's blocks recompute their
            activations in backward instead of keeping them, under every strategy (applied in
            :meth:`setup`; :mod:`phalanx.activation_checkpointing`). None: off.
    """

    @check_job_args
    def __init__(
        self,
        strategy: Strategy | str = "ddp",
        *,
        precision: str = "fp32",
        grad_accum: int = 1,
        seed: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_last: int = 3,
        metrics_file: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | None = None,
        profile_dir: str | os.PathLike[str] | None = None,
        timeline_dir: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        straggler_check_every: int = 5,
        straggler_rule: StragglerRule | None = None,
        recovery: str | None = None,
        save_on_sigterm: bool = True,
        skip_nonfinite: bool = False,
        activation_checkpointing: ActivationCheckpointing | str | None = None,
    ) -> None:
        # A preset's own errors and live recovery's rules come before any process group.
        joined = job_start.start(recovery, overridden(resolve(strategy)), grad_accum, backend)
        self.owns_group = joined.owns_group
        self.joined = joined
        """How the job joined its group (``train/job_start.py``)."""
        self.strategy = joined.strategy
        """The strategy's options (a preset name resolved: ``Job("zero2").strategy`` is
        ``Zero(stage=2)``)."""
        world = joined.world
        self.seed = seed
        """The seed given (None: no generator was seeded)."""
        self.activation_checkpointing = activation_checkpointing
        self.data_seed = DATA_SEED if seed is None else seed
        """The loaders' shuffle seed (and an injected straggler's draw): the same on every rank."""
        options = JobOptions(precision, grad_accum, checkpoint_dir)
        try:  # a mistake in any option leaves no half-made job (nor its process group) behind
            self.precision = Precision(precision, world.device)
            self.nonfinite = guard_for(skip_nonfinite, world, self.precision, joined, self.strategy)
            """The non-finite step guard (``skip_nonfinite``; :mod:`phalanx.train.nonfinite`)."""
            runner = self.strategy.start(world, options)
        except ValueError:
            if self.owns_group:
                pg.destroy_process_group()
            raise
        self.state = TrainState(self.precision)
        """What the job trains and where it is: step, epoch, the open accumulation window,
        scheduler, sampler, tracked objects (see :mod:`phalanx.train.train_state`)."""
        hooks = LoopHooks(self._pass_started, self._next_batch, self._pass_ended)
        self.resume_point = ResumePoint(self.state, hooks)
        """The job's place in its data and the moment a checkpoint resumes at (the loader's
        position, generator states; :mod:`phalanx.train.resume_point`)."""
        self.checkpoints = Checkpoints(
            checkpoint_dir, keep_last, self.state, self.resume_point, runner, joined.saves()
        )
        """Save, resume and track (:mod:`phalanx.train.job_checkpoint`)."""
        self.runner: Runner = joined.wrap(runner, self.state, self.checkpoints)
        """The strategy at work: the protocol this job calls (see ``strategies/base.py``)."""
        self.loss_fn: LossFn | None = None
        live = joined.live is not None
        timeline = None if timeline_dir is None else os.fspath(timeline_dir)
        view = JobView(world, self.strategy.lockstep and not live, live, timeline, self)
        try:  # e.g. PHALANX_TIMELINE_SYNC_EVERY refused: no process group left behind either
            watchers = observers.start(view)
        except ValueError:
            if self.owns_group:
                pg.destroy_process_group()
            raise
        self.timing = JobPhases(
            world, straggler_check_every, straggler_rule, self.runner.role.peer_sets(), watchers
        )
        """Phase marks and the straggler monitor (see :mod:`phalanx.train.job_phases`)."""
        self.grad_accum = grad_accum
        if seed is not None:
            seed_everything(seed)
        configure_logging(world.rank)
        self.metrics = MetricsLogger.for_job(
            metrics_file, checkpoint_dir, tensorboard_dir, self.runner.role.metrics_group()
        )
        self.profiler = profile(profile_dir)
        catch = save_on_sigterm and checkpoint_dir is not None and self.strategy.lockstep
        self.preemption = Preemption(world, catch and self.checkpoints.policy.preemptible)
        """SIGTERM caught as a preemption (:mod:`phalanx.train.preemption`)."""
        self._closed = False
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedule = "step"
        """When the job steps :attr:`scheduler`: "step", "epoch" or "manual" (see ``setup``)."""
        self.slowdown: Slowdown | None = None
        """An injected straggler (:meth:`slow_down`), for experiments."""
        self.throughput = Timer()
        """Samples and seconds of the epochs so far (``summary()``'s samples/s)."""

    @property
    def live(self) -> LiveTraining | None:
        """Live recovery at work (``recovery="live"``), else None: its ``regroups`` and
        ``ledger`` say what happened (``train/live_runner.py`` wraps the runner in it)."""
        return self.joined.live

    @property
    def world(self) -> World:
        """This process's place in the job (live recovery changes it with the membership)."""
        return self.runner.world

    @property
    def tracked(self) -> dict[str, Stateful]:
        """Objects checkpointed by name with every save (:meth:`track`)."""
        return self.state.tracked

    @property
    def scheduler(self) -> Scheduler | None:
        """The learning-rate scheduler given to :meth:`setup`."""
        return self.state.scheduler

    @scheduler.setter
    def scheduler(self, value: Scheduler | None) -> None:
        self.state.scheduler = value

    @property
    def sampler(self) -> DistributedSampler | ElasticSampler | None:
        """The sampler of the job's training loader (None before :meth:`loader`)."""
        return self.state.sampler

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored on resume)."""
        return self.state.step

    @property
    def epoch(self) -> int:
        """The epoch in training (see :attr:`TrainState.epoch`)."""
        return self.state.epoch

    @property
    def resumed_extra(self) -> dict[str, object]:
        """The keyword values given to the ``save()`` this job resumed from (see :meth:`save`)."""
        return self.state.resumed_extra

    # ---- setup ---------------------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Scheduler | None = None,
        *,
        loss_fn: LossFn | None = None,
        schedule: str = "step",
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Move ``model`` to this rank's device, wrap it with the strategy, keep the optimizer.

        Build the optimizer on the unwrapped model's parameters before calling this (the
        strategies here keep parameter identity), or pass None and build it afterwards on the
        returned model and assign ``job.optimizer``. ZeRO strategies need it here: they return
        a sharded optimizer of the same class and options (use the returned one), and so do
        ``phalanx.Mesh`` and parameter servers, over this rank's parameters.

        ``loss_fn(output, targets)`` is what :meth:`forward_backward` minimises; a
        ``phalanx.Mesh`` needs it (the last pipeline stage computes the loss), except for a
        :class:`phalanx.models.GPT`, whose default is the vocabulary-parallel cross-entropy
        over ``job.groups.tp``.

        ``schedule`` says when the job steps ``scheduler``: "step" (after each optimizer step),
        "epoch" or "manual" (``ReduceLROnPlateau``; see :mod:`phalanx.train.lr_schedule`).
        """
        self.schedule = check_schedule(schedule, scheduler, self.runner)
        self.precision.place(model, self.world.device)
        if self.activation_checkpointing is not None:
            checkpoint_activations(model, self.activation_checkpointing)
        self.checkpoints.epoch_scheduler = self.schedule == "epoch"
        made = self.runner.setup(model, optimizer, scheduler, loss_fn, self.precision)
        self.model, self.optimizer, self.state.scheduler = made.model, made.stepped, made.scheduler
        self.loss_fn = made.loss_fn
        self._arm_sync()
        self.runner.attach_phases(self.timing.enter)
        return made.model, made.optimizer

    def loader(
        self,
        dataset: Sized,
        batch_size: int,
        *,
        shuffle: bool | None = None,
        drop_last: bool = False,
        even_batches: bool = True,
        eval: bool = False,
        **kwargs: object,
    ) -> torch.utils.data.DataLoader[object]:
        """A DataLoader over this rank's shard: the job's resumable training loader, or with
        ``eval=True`` one that reads every sample exactly once (``train/job_data.py``).

        The job has one training loader: a new one (made inside the epoch loop, say) takes
        over the previous one's place, so its epoch and position are the job's."""
        if not eval:
            batch_size = batch_for(batch_size, self.runner.data_shard()[0])
        args = LoaderArgs(
            dataset, batch_size, shuffle, drop_last, even_batches, self.data_seed, kwargs
        )
        if eval:
            return eval_loader(args, *self.runner.data_shard())
        return self.runner.loader(args, self.state, self.resume_point)

    def gather(self, value: torch.Tensor | Number) -> torch.Tensor | list[Number]:
        """``value`` from every replica, in replica (rank) order: exact evaluation metrics.

        A tensor of any leading size per rank (an ``eval=True`` loader's uneven predictions)
        comes back joined along dimension 0; a number as the list of every replica's. It runs
        over the data-parallel group (``job.groups.dp``; a parameter server's workers), once per
        value after the eval loop: collective there. An eval loader pads nothing to drop.

        Raises:
            TypeError: ``value`` is neither a tensor nor a number.
            ValueError: the ranks' tensors differ in dtype or beyond dimension 0 (on every
                rank alike); called on a parameter-server rank.
        """
        if self.is_server:
            raise ValueError("Job.gather(): a parameter-server rank holds no replica's values")
        return gather(value, self.runner.replica_group(), self.world.device)

    @check_slow_down
    def slow_down(self, who: int | str, factor: float) -> None:
        """Before the loop: make rank (or parameter-server worker) ``who``, or a random one
        each step (``"random"``), ``factor`` times slower (:mod:`phalanx.train.slowdown`)."""
        place = self.runner.role.participants(self.world)
        if place is not None:  # servers do not compute steps
            count, index = place
            self.slowdown = Slowdown(factor, who, index=index, count=count, seed=self.data_seed)

    # ---- the loop ------------------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """Yield epoch numbers ``start..n-1``, resuming from the newest checkpoint if any."""
        n = check_epochs(n)
        if self.runner.role.serving():
            return
        epoch = self.resume()  # the epoch, where the job has its state already
        if epoch >= n and self.step_count and self.world.is_main:  # a finished run, started again
            log.info(
                "nothing left to train: the checkpoint is at epoch %d and epochs(%d) ends there; "
                "raise the count to train on, or pass another checkpoint_dir to start afresh",
                epoch,
                n,
            )
        self.state.epochs_driven = True
        while epoch < n:
            if self.preemption.stopping:  # SIGTERM after the previous epoch's last step
                self._stop_preempted()
            self.state.epoch = epoch  # the job's loader reads it when iterated
            yield epoch
            if self.schedule == "epoch" and self.scheduler is not None:
                self.scheduler.step()
            if self.runner.role.finished():
                break
            # A live ZeRO job may roll back into the epoch before; the next follows that one.
            epoch = self.epoch + 1
        self.runner.role.finish()

    def progress(self, loader: Iterable[object], desc: str | None = None) -> Iterator[object]:
        """Iterate ``loader`` with a progress bar on rank 0, moving batches to the device.

        Batches of any structure are moved (tensors inside tuples, lists, dicts, namedtuples,
        ``UserDict`` mappings such as Hugging Face's ``BatchEncoding``; see
        ``loop_helpers.to_device``). A training loader's batch is a micro-step: the
        gradient-sync flag is armed, parameter servers pull, phases are marked. An
        ``eval=True`` loader's batches are only moved (also after training, on
        parameter-server workers).
        """
        from phalanx.train.progress import progress as bar_over

        shown = self.world.rank == self.runner.role.progress_rank()
        if isinstance(loader, EvalLoader):
            bar = bar_over(loader, desc=desc or "eval", total=len(loader), enabled=shown)
            for batch in bar if not self.is_server else ():
                yield to_device(batch, self.world.device)
            return
        if self.runner.role.serving():
            return
        batches = iter(loader)  # the job's loader moves to the job's epoch here: count after
        total = batches_left(loader, self.sampler)
        bar = bar_over(batches, desc=desc or f"epoch {self.epoch}", total=total, enabled=shown)
        if isinstance(loader, ResumableLoader):  # it runs the job's hooks itself
            for batch in bar:
                yield to_device(batch, self.world.device)
            return
        self._pass_started()  # another loader (the live one, a user's own): hooks from here
        try:
            for i, batch in enumerate(bar):
                if not self._next_batch(total is not None and i == total - 1, batch_len(batch)):
                    break
                yield to_device(batch, self.world.device)
        finally:
            self._pass_ended()

    def _pass_started(self) -> None:
        """A pass over the job's loader begins (``LoopHooks.started``)."""
        self.throughput.start_epoch()
        self.timing.enter("data")

    def _next_batch(self, last: bool, n_samples: int) -> bool:
        """A training batch of ``n_samples`` is about to be handed out (``last``: the epoch's
        last; ``LoopHooks.batch``): stop for SIGTERM, arm the gradient sync, pull fresh
        parameters (parameter servers), start the step's clock; False: stop the epoch."""
        if self.preemption.stopping:
            self._stop_preempted()
        self.state.last_batch = last
        self._arm_sync()
        if self.runner.role.serving() or not self.runner.role.before_batch():
            return False  # a parameter server served instead, or stopped this worker
        if self.slowdown is not None:
            self.slowdown.begin()
        self.timing.mark_batch()
        self.throughput.count(n_samples)
        self.profiler.step()
        return True

    def _pass_ended(self) -> None:
        """The pass ended (``LoopHooks.ended``): the time until the next is no step's phase
        (evaluation, checkpoints)."""
        self.timing.enter(None)

    def _arm_sync(self) -> None:
        # DDP decides at *forward* time whether the coming backward communicates (torch's and
        # ours alike), so the flag is set before each micro-step's forward, not in backward.
        self.runner.require_backward_grad_sync(self.state.syncs_now(self.grad_accum))

    def forward_backward(self, inputs: object, targets: object) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and its backward, for every strategy.

        A pipeline runs its whole schedule here (micro-batches, every stage) and averages the
        gradients over the data-parallel group. Returns the batch's mean loss, detached.
        """
        if self.model is None or self.loss_fn is None:
            raise ValueError("Job.forward_backward() needs Job.setup(model, ..., loss_fn=...)")
        loss = self.runner.forward_backward(inputs, targets, self.loss_fn, self.backward)
        self.timing.enter("optimizer")
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / grad_accum``; gradients sync only on the last micro-step."""
        self.timing.mark_backward()
        self.timing.loss(loss)
        self.runner.backward(loss, self.precision, self.grad_accum)
        self.timing.enter("optimizer")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by the whole model's norm and return it, as torch's
        ``clip_grad_norm_`` on one process; call it between the step's last ``backward`` and
        ``step()``.

        In fp16 the gradients are unscaled first (once per step; ``step()`` does not unscale
        again). On a micro-step still accumulating it clips nothing and returns NaN.

        Raises:
            ValueError: a parameter-server strategy (the servers apply each worker's own
                gradient), no model set up, or a bad ``max_norm`` / ``norm_type``.
        """
        max_norm, norm_type = check_clip(max_norm, norm_type)
        if self.model is None:
            raise ValueError("Job.clip_grad_norm_() needs Job.setup(model, ...) first")
        if not self.state.syncs_now(self.grad_accum):
            return torch.tensor(float("nan"))
        if self.precision.scaler is not None:
            if self.optimizer is None:
                raise ValueError("Job.clip_grad_norm_() in fp16 needs the optimizer in setup()")
            self.precision.unscale_(self.optimizer, self.runner.grad_shards(self.optimizer))
        return self.runner.clip_grad_norm_(max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step the optimizer (and with ``schedule="step"`` the scheduler) at the end of an
        accumulation window: ``job.step()``.

        Args:
            optimizer: Leave it out: the job steps the optimizer given to :meth:`setup` (or set
                as ``job.optimizer``). Pass one only when the job was given none.

        Returns:
            True when the optimizer stepped (False within an accumulation window, and for a
            step that ``skip_nonfinite`` skipped).
        """
        opt = optimizer or self.optimizer
        # Micro-steps done in this window; back to 0 ends it (so does the epoch's last batch).
        state = self.state
        state.micro = 0 if state.last_batch else (state.micro + 1) % self.grad_accum
        self.resume_point.stepped(pending=state.micro != 0)
        self._arm_sync()
        if state.micro:
            self.timing.enter("data")  # the next micro-batch
            return False
        self.timing.enter("optimizer")
        if self.slowdown is not None:
            self.slowdown.end(self.step_count)
        self.timing.stepping(self.step_count + 1)
        # Parameter servers step the optimizer (and scheduler) on the servers: False.
        skipped = self.nonfinite.skipped(opt, self.runner, self.step_count + 1)
        stepped = False if skipped else self.runner.step(opt, self.precision)
        if stepped is None:
            return False  # a live job's failed step: redone
        if stepped and self.schedule == "step" and self.scheduler is not None:
            self.scheduler.step()
        state.step += 1
        if not self.runner.after_step():
            return False  # a live ZeRO job lost a member here and rolled this step back
        self.timing.end_step(self.step_count, self.metrics)
        self.preemption.reached(self.step_count)  # the stop comes before the next batch
        return not skipped

    def _stop_preempted(self) -> NoReturn:
        """SIGTERM, the agreed step done: commit its checkpoint (unless the loop saved it
        already) and exit with status 143; ``with`` / ``close()`` close the job."""
        self.preemption.acted = True
        path = self.checkpoints.commit_step()
        if self.world.is_main:
            log.warning("SIGTERM: step %d committed in %s; exiting", self.step_count, path)
        raise SystemExit(EXIT_STATUS)

    # ---- metrics and checkpoints -----------------------------------------------------------------
    def track(self, name: str, obj: Stateful) -> Stateful:
        """Checkpoint ``obj`` (anything with ``state_dict()`` / ``load_state_dict()``) under
        ``name`` with every :meth:`save` and load it on resume; call it before ``epochs()``.
        Returns ``obj`` (``train/job_checkpoint.py``)."""
        self.checkpoints.track(name, obj)
        return obj

    def save(self, *, async_: bool = True, **extra: object) -> Path:
        """Write a checkpoint of the model, optimizer, scheduler, tracked objects, sampler,
        RNG, step and fp16 loss scale; call it after any ``step()``, mid-epoch or not.
        ``extra`` (JSON-able values) comes back in :attr:`resumed_extra` on resume. By
        default it returns once the state is staged and writes in the background (the next
        ``save`` and ``close()`` wait); ``async_=False`` commits before returning
        (``train/job_checkpoint.py``)."""
        path = self.checkpoints.save(async_, **extra)
        self.timing.saved(self.step_count)
        return path

    def resume(self) -> int:
        """Load the newest committed checkpoint (if any); return the epoch to start from
        (``range(job.resume(), n)`` is the plain loop's ``job.epochs(n)``)."""
        return self.checkpoints.resume()

    def log(self, **metrics: float) -> dict[str, float]:
        """Average ``metrics`` over the ranks, write them (rank 0) and return the averages.

        Parameter-server workers are not in step with each other (one may be told to stop
        while another is mid-epoch), so there each worker returns its own values, without
        communication, and the first worker writes its own.
        """
        in_step = self.runner.role.logs_in_step()
        record = self.metrics.log if in_step else self.metrics.log_local
        averaged = record(self.step_count, **metrics)
        if self.metrics.is_writer:
            shown = " ".join(f"{k}={v:.4g}" for k, v in averaged.items())
            log.info("epoch %d step %d: %s", self.epoch, self.step_count, shown)
        return averaged

    def close(self) -> None:
        """Wait for a background checkpoint write (raising its error); flush metrics; leave
        the process group if the job created it. Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.checkpoints.wait()  # before the process group, whose store the write uses
        finally:
            self.runner.role.finish()
            self.timing.close()
            self.metrics.close()
            self.profiler.stop()
            self.runner.close()
            if self.owns_group:
                pg.destroy_process_group()
            self.preemption.close()  # last: a SIGTERM never acted on is raised again here

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
