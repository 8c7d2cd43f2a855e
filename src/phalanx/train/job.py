"""``phalanx.Job``: a whole distributed training job in a few calls.

    job = phalanx.Job(phalanx.DDP(), precision="bf16-mixed", grad_accum=4, checkpoint_dir="ckpt")
    model, optimizer = job.setup(model, optimizer, scheduler)  # stepped with the optimizer
    loader = job.loader(dataset, batch_size=64, shuffle=True)
    job.track("stats", stats)                     # any state_dict() object, checkpointed
    for epoch in job.epochs(10):                  # resumes from the newest checkpoint
        for x, y in job.progress(loader):         # tqdm on rank 0
            job.backward(loss_fn(model(x), y))    # syncs only on the last micro-step
            job.clip_grad_norm_(1.0)              # unscaled, over every rank's shard
            job.step(optimizer)
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

import torch
from torch import nn

from phalanx.comm import group as pg
from phalanx.data.eval import EvalLoader, EvalSampler
from phalanx.data.sampler import DistributedSampler
from phalanx.mesh.groups import ParallelGroups
from phalanx.parameter_server import ServerReport
from phalanx.train import job_checkpoint
from phalanx.train.gather import Number, gather
from phalanx.train.job_args import check_clip, check_epochs, check_job_args, check_slow_down
from phalanx.train.job_phases import JobPhases
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
from phalanx.train.phases import PhaseClock
from phalanx.train.precision import Precision
from phalanx.train.profiling import profile
from phalanx.train.resume_point import ResumableLoader, ResumePoint
from phalanx.train.slowdown import Slowdown
from phalanx.train.straggler_rule import StragglerFinding, StragglerRule
from phalanx.train.strategies import JobOptions, Runner, Strategy, resolve
from phalanx.train.strategies.base import LossFn, Scheduler, Stateful
from phalanx.train.strategies.mesh import MeshRunner
from phalanx.train.strategies.ps import PSRunner

__all__ = ["DATA_SEED", "Job"]

log = logging.getLogger(__name__)

DATA_SEED = 0
"""The loaders' shuffle seed of a ``Job(seed=None)`` (torch's ``DistributedSampler`` default):
a constant, so every rank agrees without a broadcast and every run shuffles alike."""


class Job:
    """One distributed training job: process group, strategy, data, steps, metrics, checkpoints.

    Args:
        strategy: A strategy (``phalanx.DDP()``, ``phalanx.Zero(stage=2)``,
            ``phalanx.Mesh(pp=2, micro_batches=4)``, ``phalanx.PS(mode="ssp", staleness=2)``,
            ...) or a preset name ("ddp", "zero2", "pipeline", ...; ``strategy_names()``).
        precision: "fp32", "bf16-mixed" (autocast, CPU and GPU), "fp16-mixed" (autocast and a
            gradient scaler, GPU) or "bf16-true" (the model, its gradients and optimizer state
            in bf16); "bf16" and "fp16" are the mixed ones (``phalanx.precisions``).
        grad_accum: Micro-steps per optimizer step; gradients sync only on the last one.
        seed: None (the default) touches no random generator: seed your own code as you
            would without phalanx. An int seeds torch, numpy and random with it on every rank
            (so a model built after ``Job()`` is the same on every rank, which strategies that
            keep each rank's piece of the model it built need: ``Mesh`` with tp > 1, ``PS``
            with several servers, ``TorchFSDP``; DDP, ``Zero`` and a pipeline's replicas
            start from one rank's parameters anyway) and is the loaders' shuffle seed. With
            None the shuffle seed is :data:`DATA_SEED` (0, torch's ``DistributedSampler``
            default): the same on every rank without communication, and the same run after
            run, so a resumed job (which also restores the sampler's seed from the
            checkpoint) shuffles as the saved one.
        checkpoint_dir: Where :meth:`save` writes and :meth:`epochs` resumes from.
        keep_last: Committed checkpoints to keep.
        metrics_file: JSONL file for :meth:`log` (default ``checkpoint_dir/metrics.jsonl``).
        tensorboard_dir: Also write metrics to TensorBoard (``pip install 'phalanx[tensorboard]'``).
        profile_dir: Write a torch.profiler trace per rank here (Perfetto / chrome://tracing).
        backend: c10d backend when the job initialises the process group.
        straggler_check_every: Every this many steps the ranks gather their per-step compute
            per phase (one small asynchronous all-gather; 0 disables); a rank standing out in
            one phase for several steps is named, with the phase, in the log, the metrics and
            :attr:`straggler_finding` (see ``train/straggler_rule.py``).
        straggler_rule: The detector's margins and persistence (``phalanx.train.StragglerRule``).
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
        backend: str | None = None,
        straggler_check_every: int = 5,
        straggler_rule: StragglerRule | None = None,
    ) -> None:
        chosen = resolve(strategy)  # a preset's own errors come before any process group
        self.strategy = chosen
        """The strategy's options (a preset name resolved: ``Job("zero2").strategy`` is
        ``Zero(stage=2)``)."""
        self.owns_group = not pg.is_initialized()
        self.world = pg.init_process_group(backend) if self.owns_group else pg.world()
        self.seed = seed
        """The seed given (None: no generator was seeded)."""
        self.data_seed = DATA_SEED if seed is None else seed
        """The loaders' shuffle seed (and an injected straggler's draw): the same on every rank."""
        options = JobOptions(precision, grad_accum, checkpoint_dir)
        try:  # a mistake in any option leaves no half-made job (nor its process group) behind
            self.precision = Precision(precision, self.world.device)
            self.runner: Runner = chosen.start(self.world, options)
            """The strategy at work: the protocol this job calls (see ``strategies/base.py``)."""
        except ValueError:
            if self.owns_group:
                pg.destroy_process_group()
            raise
        self.loss_fn: LossFn | None = None
        self.timing = JobPhases(
            self.world, straggler_check_every, straggler_rule, self.runner.peer_sets()
        )
        """Phase marks and the straggler monitor (see :mod:`phalanx.train.job_phases`)."""
        self.grad_accum = grad_accum
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        if seed is not None:
            seed_everything(seed)
        configure_logging(self.world.rank)
        self.metrics = MetricsLogger.for_job(
            metrics_file, checkpoint_dir, tensorboard_dir, self.runner.metrics_group()
        )
        self.profiler = profile(profile_dir)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Scheduler | None = None
        self.schedule = "step"
        """When the job steps :attr:`scheduler`: "step", "epoch" or "manual" (see ``setup``)."""
        self.tracked: dict[str, Stateful] = {}
        """Objects checkpointed by name with every save (:meth:`track`)."""
        self.sampler: DistributedSampler | None = None
        self.slowdown: Slowdown | None = None
        """An injected straggler (:meth:`slow_down`), for experiments."""
        self.step_count = 0
        """Optimizer steps taken (restored on resume)."""
        self.epoch = 0
        self._micro = 0
        self._last_batch = False
        self._resumed = False
        self._resume_point = ResumePoint(accumulates=grad_accum > 1)
        self.resumed_extra: dict[str, object] = {}
        """The keyword values given to the ``save()`` this job resumed from (see :meth:`save`)."""
        self._timer = Timer()

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

        ``schedule`` says when the job steps ``scheduler`` (see :mod:`phalanx.train.lr_schedule`):
        "step" after each optimizer step (Accelerate's way; parameter servers step it on the
        servers), "epoch" at the end of each epoch, "manual" never (call ``scheduler.step()``
        yourself; ``ReduceLROnPlateau`` needs this, for ``scheduler.step(val_loss)``). It is
        checkpointed and resumed whichever it is.
        """
        self.schedule = check_schedule(schedule, scheduler, self.runner)
        self.precision.place(model, self.world.device)
        made = self.runner.setup(model, optimizer, scheduler, loss_fn, self.precision)
        self.model, self.optimizer, self.scheduler = made.model, made.stepped, made.scheduler
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
        """A DataLoader over this rank's shard: ranks of one replica read the same samples,
        replicas different ones.

        Training (the default, shuffled unless ``shuffle=False``): the job's sampler
        (``phalanx.DistributedSampler``, :attr:`sampler`), which pads the replicas to equal
        full batches (``even_batches``) and is set to each epoch by :meth:`epochs`; its
        position advances as batches are handed out (loop over the loader or
        ``job.progress(loader)``), so :meth:`save` can be called after any step.

        ``eval=True``: every sample exactly once over the replicas, never repeated nor dropped
        (``phalanx.data.eval.EvalSampler``: contiguous blocks, in the dataset's order unless
        ``shuffle=True``). Replicas may get different numbers of batches, so run no collective
        per batch: collect the outputs and :meth:`gather` them after the loop. It is not the
        job's sampler (checkpoints neither record nor change it); ``drop_last`` and
        ``even_batches`` do not apply.
        """
        replicas, replica = self.runner.data_shard()
        for given in ("sampler", "batch_sampler"):
            if given in kwargs:
                raise ValueError(
                    f"Job.loader({given}={kwargs[given]!r}): the job builds its own sampler "
                    f"(eval=True for evaluation); drop {given}="
                )
        if eval:  # not shuffled unless asked; not the job's sampler
            order = False if shuffle is None else shuffle
            sampler = EvalSampler(dataset, replicas, replica, order, self.data_seed)
            return EvalLoader(dataset, batch_size, sampler=sampler, **kwargs)  # type: ignore[arg-type]
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=replica,
            shuffle=True if shuffle is None else shuffle,
            seed=self.data_seed,
            drop_last=drop_last,
            even_batches=even_batches,
            batch_size=batch_size,
        )
        self._resume_point.follow(self.sampler)
        return ResumableLoader(
            self._resume_point,
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            **kwargs,
        )

    def gather(self, value: torch.Tensor | Number) -> torch.Tensor | list[Number]:
        """``value`` from every replica, in replica (rank) order: exact evaluation metrics.

        A tensor of any leading size per rank (the predictions of an ``eval=True`` loader's
        uneven batches, concatenated) comes back as one tensor joined along dimension 0; a
        Python number as the list of every replica's. Ranks of one replica (pipeline stages,
        tensor shards of a ``phalanx.Mesh``) read the same samples, so the gather runs over
        the data-parallel group only (``job.groups.dp``; the workers of a parameter server).
        Collective: every rank of that group calls it, once per value (after the eval loop,
        not per batch). Nothing is dropped or deduplicated: an eval loader pads nothing.

        Raises:
            TypeError: ``value`` is neither a tensor nor a number.
            ValueError: the ranks' tensors differ in dtype or beyond the first dimension
                (on every rank alike); called on a parameter-server rank.
        """
        if self.is_server:
            raise ValueError("Job.gather(): a parameter-server rank holds no replica's values")
        return gather(value, self.runner.replica_group(), self.world.device)

    @check_slow_down
    def slow_down(self, who: int | str, factor: float) -> None:
        """Make rank (or parameter-server worker) ``who``, or a random one each step with
        ``who="random"``, ``factor`` times slower: the straggler of experiments
        (:mod:`phalanx.train.slowdown`). Call it before the loop."""
        place = self.runner.participants()
        if place is not None:  # servers do not compute steps
            count, index = place
            self.slowdown = Slowdown(factor, who, index=index, count=count, seed=self.data_seed)

    # ---- the loop ------------------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """Yield epoch numbers ``start..n-1``, resuming from the newest checkpoint if any."""
        n = check_epochs(n)
        if self.runner.serving():
            return
        start = self.resume() if not self._resumed else self.epoch
        for epoch in range(start, n):
            self.epoch = epoch
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            yield epoch
            if self.schedule == "epoch" and self.scheduler is not None:
                self.scheduler.step()
            if self.runner.finished():
                break
        self.runner.finish()

    def progress(self, loader: Iterable[object], desc: str | None = None) -> Iterator[object]:
        """Iterate ``loader`` with a progress bar on rank 0, moving batches to the device.

        Batches of any structure are moved (tensors inside tuples, lists, dicts, namedtuples,
        ``UserDict`` mappings such as Hugging Face's ``BatchEncoding``; see
        ``loop_helpers.to_device``). An ``eval=True`` loader's batches are only moved: no
        step timing, gradient-sync flag or parameter-server pull around them.
        """
        from phalanx.train.progress import progress

        shown = self.world.rank == self.runner.progress_rank()
        if isinstance(loader, EvalLoader):  # also after training (parameter-server workers)
            bar = progress(loader, desc=desc or "eval", total=len(loader), enabled=shown)
            for batch in bar if not self.is_server else ():
                yield to_device(batch, self.world.device)
            return
        if self.runner.serving():
            return
        total = batches_left(loader, self.sampler)
        bar = progress(loader, desc=desc or f"epoch {self.epoch}", total=total, enabled=shown)
        self._timer.start_epoch()
        self.timing.enter("data")
        try:
            for i, batch in enumerate(bar):
                self._last_batch = total is not None and i == total - 1
                self._arm_sync()
                if not self._before_batch():
                    break
                batch = to_device(batch, self.world.device)
                self.timing.mark_batch()
                yield batch
                self._timer.count(batch_len(batch))
                self.profiler.step()
        finally:  # evaluation and checkpoints between epochs are no step's phase
            self.timing.enter(None)

    def _before_batch(self) -> bool:
        """Pull fresh parameters (parameter servers) and start the step's clock; False: stop."""
        if not self.runner.before_batch():
            return False
        if self.slowdown is not None:
            self.slowdown.begin()
        return True

    def _arm_sync(self) -> None:
        # DDP decides at *forward* time whether the coming backward communicates (torch's and
        # ours alike), so the flag is set before each micro-step's forward, not in backward.
        last = self._micro + 1 >= self.grad_accum or self._last_batch
        self.runner.require_backward_grad_sync(last)

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
        self.precision.backward(loss / self.grad_accum if self.grad_accum > 1 else loss)
        self.timing.enter("optimizer")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by the whole model's norm, as ``torch.nn.utils.clip_grad_norm_``
        on one process would; return that norm (a tensor). Call it between the last
        ``backward`` of a step and ``step()``.

        In fp16 the gradients are unscaled first (the scaler's ``unscale_``, once per step:
        ``step()`` then does not unscale again). The norm spans every rank's part where
        parameters are split: ZeRO-1/2's optimizer ranges, ZeRO-3's flat shards, a mesh's
        pipeline stages and tensor shards (collective there: every rank calls it). On a
        micro-step whose gradients are still accumulating (``grad_accum``) nothing is clipped
        and NaN is returned: clip on the step where ``step()`` will return True.

        Raises:
            ValueError: a parameter-server strategy (the servers apply each worker's own
                gradient), no model set up, or a bad ``max_norm`` / ``norm_type``.
        """
        max_norm, norm_type = check_clip(max_norm, norm_type)
        if self.model is None:
            raise ValueError("Job.clip_grad_norm_() needs Job.setup(model, ...) first")
        if not (self._micro + 1 >= self.grad_accum or self._last_batch):
            return torch.tensor(float("nan"))
        scaler = self.precision.scaler
        if scaler is not None:
            if self.optimizer is None:
                raise ValueError("Job.clip_grad_norm_() in fp16 needs the optimizer in setup()")
            scaler.unscale_(self.optimizer)
        return self.runner.clip_grad_norm_(max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step the optimizer (and with ``schedule="step"`` the scheduler) at the end of an
        accumulation window.

        Returns:
            True when the optimizer stepped.
        """
        opt = optimizer or self.optimizer
        # Micro-steps done in this window; back to 0 ends it (so does the epoch's last batch).
        self._micro = 0 if self._last_batch else (self._micro + 1) % self.grad_accum
        self._resume_point.stepped(pending=self._micro != 0)
        self._arm_sync()
        if self._micro:
            self.timing.enter("data")  # the next micro-batch
            return False
        self.timing.enter("optimizer")
        if self.slowdown is not None:
            self.slowdown.end(self.step_count)
        # Parameter servers step the optimizer (and the scheduler) on the servers.
        stepped_here = self.runner.step(opt, self.precision)
        if stepped_here and self.schedule == "step" and self.scheduler is not None:
            self.scheduler.step()
        self.step_count += 1
        self.timing.end_step(self.step_count, self.metrics)
        return True

    # ---- metrics and checkpoints -----------------------------------------------------------------
    def track(self, name: str, obj: Stateful) -> Stateful:
        """Checkpoint ``obj`` under ``name`` with every :meth:`save`; load it when the job
        resumes. Returns ``obj``.

        ``obj`` is anything with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``
        protocol: a metric, an EMA of the weights, a data-loader state, a counter...) whose
        state is tensors and JSON-able values (nothing is pickled); rank 0's is saved and every
        rank loads it. Call it before ``job.epochs()``, which resumes.

        Raises:
            TypeError: ``name`` is not a string, or ``obj`` lacks the two methods.
            ValueError: ``name`` is empty or tracked already, or the job has resumed already.
        """
        job_checkpoint.track(self, name, obj)
        return obj

    def save(self, **extra: object) -> Path:
        """Write a checkpoint of the model, optimizer, scheduler, tracked objects, sampler,
        RNG, step and fp16 loss scale; call it after any ``step()``, mid-epoch or not.
        ``extra`` (JSON-able values) comes back in :attr:`resumed_extra` on resume
        (``train/job_checkpoint.py``)."""
        return job_checkpoint.save(self, **extra)

    def resume(self) -> int:
        """Load the newest committed checkpoint (if any); return the epoch to start from."""
        return job_checkpoint.resume(self)

    def log(self, **metrics: float) -> dict[str, float]:
        """Average ``metrics`` over the ranks, write them (rank 0) and return the averages.

        Parameter-server workers are not in step with each other (one may be told to stop
        while another is mid-epoch), so there each worker returns its own values, without
        communication, and the first worker writes its own.
        """
        record = self.metrics.log if self.runner.logs_in_step() else self.metrics.log_local
        averaged = record(self.step_count, **metrics)
        if self.metrics.is_writer:
            shown = " ".join(f"{k}={v:.4g}" for k, v in averaged.items())
            log.info("epoch %d step %d: %s", self.epoch, self.step_count, shown)
        return averaged

    def summary(self) -> dict[str, float]:
        """Samples/s over the job, this rank's seconds waiting for communication
        (``comm_wait_seconds``) and their share of its time (``comm_share``; :meth:`phase_shares`
        has each phase's). Both are NaN where the strategy's wait is not measured (a torch
        version without the hook used), never a silent 0."""
        share = self.timing.shares()["communication_share"]
        waited = sum(self.timing.clock.total_wait)
        if not self.runner.comm_measured:
            share = waited = float("nan")
        times = self._timer.summary(self.world.world_size)
        return {**times, "comm_share": share, "comm_wait_seconds": waited}

    def phase_shares(self) -> dict[str, float]:
        """Each phase's share of this rank's measured time (``data_share``, ...,
        ``communication_share``): compute phases exclude the communication waited inside them."""
        return self.timing.shares()

    @property
    def phases(self) -> PhaseClock:
        """This rank's time per phase (see :mod:`phalanx.train.phases`)."""
        return self.timing.clock

    @property
    def straggler_finding(self) -> StragglerFinding | None:
        """The latest rank (and phase) found consistently slower than the others; every rank
        knows it. ``finding.phase`` is one of ``phalanx.train.phases.PHASES``."""
        return self.timing.finding

    @property
    def groups(self) -> ParallelGroups | None:
        """Process groups along dp / pp / tp of a ``phalanx.Mesh`` (None for others)."""
        return self.runner.groups if isinstance(self.runner, MeshRunner) else None

    @property
    def is_server(self) -> bool:
        """True on a parameter-server rank (which serves instead of training)."""
        return isinstance(self.runner, PSRunner) and self.runner.is_server

    @property
    def server_report(self) -> ServerReport | None:
        """What this parameter server did (server ranks, once served); None elsewhere."""
        return self.runner.report if isinstance(self.runner, PSRunner) else None

    def close(self) -> None:
        """Flush metrics; leave the process group if the job created it."""
        self.runner.finish()
        self.timing.close()
        self.metrics.close()
        self.profiler.stop()
        if self.owns_group:
            pg.destroy_process_group()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
