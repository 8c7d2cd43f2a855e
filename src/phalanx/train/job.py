"""``phalanx.Job``: a whole distributed training job in a few calls.

    job = phalanx.Job(strategy="ddp", precision="bf16", grad_accum=4, checkpoint_dir="ckpt")
    model, optimizer = job.setup(model, optimizer)
    loader = job.loader(dataset, batch_size=64, shuffle=True)
    for epoch in job.epochs(10):                  # resumes from the newest checkpoint
        for x, y in job.progress(loader):         # tqdm on rank 0
            job.backward(loss_fn(model(x), y))    # syncs only on the last micro-step
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from phalanx.comm import group as pg
from phalanx.data.sampler import DistributedSampler
from phalanx.mesh.groups import ParallelGroups
from phalanx.train.job_args import check_epochs, check_job_args
from phalanx.train.job_checkpoint import CheckpointMixin
from phalanx.train.job_data import DataMixin
from phalanx.train.job_phases import PhaseMixin
from phalanx.train.job_ps import PSMixin
from phalanx.train.loop_helpers import (
    Timer,
    batch_len,
    batches_left,
    configure_logging,
    repoint,
    seed_everything,
    to_device,
)
from phalanx.train.metrics import MetricsLogger
from phalanx.train.precision import Precision
from phalanx.train.profiling import profile
from phalanx.train.resume_point import ResumePoint
from phalanx.train.stragglers import StragglerRule
from phalanx.train.strategies import get_optimizer_hook, get_strategy

__all__ = ["Job"]

log = logging.getLogger(__name__)


class Job(CheckpointMixin, PSMixin, DataMixin, PhaseMixin):
    """One distributed training job: process group, strategy, data, steps, metrics, checkpoints.

    Args:
        strategy: A registered strategy name ("ddp", "torch-ddp", "dp", "single", ...).
        precision: "fp32", "bf16" (autocast, CPU and GPU) or "fp16" (GPU, gradient scaler).
        grad_accum: Micro-steps per optimizer step; gradients sync only on the last one.
        seed: Seeds torch, numpy and random identically on every rank (data order comes from
            the sampler's seed, so replicas start equal and shuffle in agreement).
        checkpoint_dir: Where :meth:`save` writes and :meth:`epochs` resumes from.
        keep_last: Committed checkpoints to keep.
        metrics_file: JSONL file for :meth:`log` (default ``checkpoint_dir/metrics.jsonl``).
        tensorboard_dir: Also write metrics to TensorBoard (``pip install 'phalanx[tensorboard]'``).
        profile_dir: Write a torch.profiler trace per rank here (Perfetto / chrome://tracing).
        backend: c10d backend when the job initialises the process group.
        dp, pp, tp: Data, pipeline and tensor-parallel degrees for strategy "pipeline" or
            "tensor" (the strategy's own degree defaults to every rank the others leave).
        micro_batches: Micro-batches per step of a pipeline (must divide the batch).
        schedule: Pipeline schedule: "gpipe", "1f1b" or "interleaved".
        chunks: Model chunks per pipeline rank (interleaved schedule).
        balance: Layers per pipeline stage, or "params" / "time".
        tp_plan: Module name -> "colwise" / "rowwise" / ...; GPT models have a default.
        servers, staleness, staleness_lr, max_updates: Parameter-server options of "ps-sync",
            "ps-async" and "ssp" (server ranks, SSP bound, 1/(1+staleness) scaling, budget).
        straggler: ``(who, factor)``: make rank (or parameter-server worker) ``who``, or a
            random one each step with ``who="random"``, ``factor`` times slower (experiments).
        straggler_check_every: Every this many steps the ranks gather their per-step compute
            per phase (one small asynchronous all-gather; 0 disables); a rank standing out in
            one phase for several steps is named, with the phase, in the log, the metrics and
            :attr:`straggler_finding` (see ``train/stragglers.py``).
        straggler_rule: The detector's margins and persistence (``phalanx.train.StragglerRule``).
    """

    @check_job_args
    def __init__(
        self,
        strategy: str = "ddp",
        *,
        precision: str = "fp32",
        grad_accum: int = 1,
        seed: int = 0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_last: int = 3,
        metrics_file: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | None = None,
        profile_dir: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        dp: int | None = None,
        pp: int | None = None,
        tp: int | None = None,
        micro_batches: int = 1,
        schedule: str = "1f1b",
        chunks: int = 1,
        balance: Sequence[int] | str | None = None,
        tp_plan: Mapping[str, str] | None = None,
        servers: int | None = None,
        staleness: int | None = None,
        staleness_lr: bool = False,
        max_updates: int | None = None,
        straggler: tuple[int | str, float] | None = None,
        straggler_check_every: int = 5,
        straggler_rule: StragglerRule | None = None,
    ) -> None:
        self._wrap = get_strategy(strategy)
        self.strategy = strategy
        self.owns_group = not pg.is_initialized()
        self.world = pg.init_process_group(backend) if self.owns_group else pg.world()
        from phalanx.train.parallel_strategies import parallel_config
        from phalanx.train.ps_strategies import ps_config

        self.seed = seed
        try:  # a mistake in any option leaves no half-made job (nor its process group) behind
            self.precision = Precision(precision, self.world.device)
            self.parallel = parallel_config(
                strategy,
                self.world.world_size,
                dp=dp,
                pp=pp,
                tp=tp,
                micro_batches=micro_batches,
                schedule=schedule,
                chunks=chunks,
                balance=balance,
                tp_plan=tp_plan,
            )
            """The dp x pp x tp split of strategies "pipeline" and "tensor" (None for others)."""
            self.ps_config = ps_config(
                strategy,
                self.world.world_size,
                servers=servers,
                staleness=staleness,
                staleness_lr=staleness_lr,
                max_updates=max_updates,
                checkpoint_dir=checkpoint_dir,
                precision=precision,
            )
            self._init_roles(straggler)
        except ValueError:
            if self.owns_group:
                pg.destroy_process_group()
            raise
        if self.parallel is not None and self.parallel.pp > 1 and grad_accum > 1:
            raise ValueError(
                f"grad_accum={grad_accum} with a pipeline (pp={self.parallel.pp}): the pipeline "
                f"already accumulates over micro_batches={micro_batches}; raise that instead"
            )
        self.loss_fn: Any = None
        self.groups: ParallelGroups | None = None
        """Process groups along dp / pp / tp, for strategies "pipeline" and "tensor"."""
        if self.parallel is not None:
            from phalanx.mesh import make_groups

            self.groups = make_groups(self.parallel.topology(self.world.world_size))
        self._init_phases(straggler_check_every, straggler_rule)
        self.grad_accum = grad_accum
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        seed_everything(seed)
        configure_logging(self.world.rank)
        self.metrics = MetricsLogger.for_job(
            metrics_file, checkpoint_dir, tensorboard_dir, self._worker_group()
        )
        self.profiler = profile(profile_dir)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.sampler: DistributedSampler | None = None
        self.step_count = 0
        """Optimizer steps taken (restored on resume)."""
        self.epoch = 0
        self._micro = 0
        self._last_batch = False
        self._resumed = False
        self._resume_point = ResumePoint(accumulates=grad_accum > 1)
        self.resumed_extra: dict[str, Any] = {}
        """The keyword values given to the ``save()`` this job resumed from (see :meth:`save`)."""
        self._timer = Timer()

    # ---- setup ---------------------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        loss_fn: Any = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Move ``model`` to this rank's device, wrap it with the strategy, keep the optimizer.

        Build the optimizer on the unwrapped model's parameters before calling this (the
        strategies here keep parameter identity), or pass None and build it afterwards on the
        returned model and assign ``job.optimizer``. ZeRO strategies need it here: they return
        a sharded optimizer of the same class and options (use the returned one), and so do
        "pipeline" and "tensor", over this rank's parameters.

        ``loss_fn(output, targets)`` is what :meth:`forward_backward` minimises; strategies
        "pipeline" and "tensor" need it (the last pipeline stage computes the loss), except
        for a :class:`phalanx.models.GPT`, whose default is the vocabulary-parallel
        cross-entropy over ``job.groups.tp``.
        """
        model.to(self.world.device)
        self.loss_fn = loss_fn
        if self.ps_config is not None:
            return self._setup_ps(model, optimizer, scheduler)
        if self.parallel is not None:
            return self._setup_parallel(model, optimizer, scheduler)
        wrapped = self._wrap(model, self.world)
        rebuild = get_optimizer_hook(self.strategy)
        if rebuild is not None:
            if optimizer is None:
                raise ValueError(
                    f"strategy={self.strategy!r} rebuilds the optimizer in its sharded form: "
                    f"pass it to Job.setup(model, optimizer)"
                )
            sharded = rebuild(wrapped, optimizer, self.world)
            if scheduler is not None:
                repoint(scheduler, sharded)
            optimizer = sharded
        self.precision.wrap_forward(wrapped)
        self.model, self.optimizer, self.scheduler = wrapped, optimizer, scheduler
        self._arm_sync()
        return wrapped, optimizer

    def _setup_parallel(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        from phalanx.train.parallel_strategies import setup_parallel

        assert self.parallel is not None and self.groups is not None
        wrapped, optimizer, self.loss_fn = setup_parallel(
            model, optimizer, self.parallel, self.loss_fn, self.groups, self.precision
        )
        if scheduler is not None and optimizer is not None:
            repoint(scheduler, optimizer)
        self.model, self.optimizer, self.scheduler = wrapped, optimizer, scheduler
        self._arm_sync()
        self._attach_phases()
        return wrapped, optimizer

    # ---- the loop ------------------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """Yield epoch numbers ``start..n-1``, resuming from the newest checkpoint if any."""
        n = check_epochs(n)
        if self._serving():
            return
        start = self.resume() if not self._resumed else self.epoch
        for epoch in range(start, n):
            self.epoch = epoch
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            yield epoch
            if self.ps is not None and self.ps.done:
                break
        self._finish_roles()

    def progress(self, loader: Iterable[Any], desc: str | None = None) -> Iterator[Any]:
        """Iterate ``loader`` with a progress bar on rank 0, moving batches to the device."""
        from phalanx.train.progress import progress

        if self._serving():
            return
        total = batches_left(loader, self.sampler)
        bar = progress(
            loader, desc=desc or f"epoch {self.epoch}", total=total, enabled=self._draws_progress()
        )
        self._timer.start_epoch()
        self.phases.enter("data")
        try:
            for i, batch in enumerate(bar):
                self._last_batch = total is not None and i == total - 1
                self._arm_sync()
                if not self._before_batch():
                    break
                batch = to_device(batch, self.world.device)
                self._mark_batch()
                yield batch
                self._timer.count(batch_len(batch))
                self.profiler.step()
        finally:  # evaluation and checkpoints between epochs are no step's phase
            self.phases.enter(None)

    def _arm_sync(self) -> None:
        # DDP decides at *forward* time whether the coming backward communicates (torch's and
        # ours alike), so the flag is set before each micro-step's forward, not in backward.
        last = self._micro + 1 >= self.grad_accum or self._last_batch
        for owner in (self.model, self.optimizer):  # DDP and ZeRO-3 models; ZeRO-2 optimizers
            if owner is not None and hasattr(owner, "require_backward_grad_sync"):
                setattr(owner, "require_backward_grad_sync", last)  # noqa: B010

    def forward_backward(self, inputs: Any, targets: Any) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and its backward, for every strategy.

        A pipeline runs its whole schedule here (micro-batches, every stage) and averages the
        gradients over the data-parallel group. Returns the batch's mean loss, detached.
        """
        if self.model is None or self.loss_fn is None:
            raise ValueError("Job.forward_backward() needs Job.setup(model, ..., loss_fn=...)")
        if getattr(self.model, "pipelined", False):
            loss = cast(torch.Tensor, self.model.train_step(inputs, targets))  # type: ignore[operator]
            self.phases.enter("optimizer")
            return loss
        loss = self.loss_fn(self.model(inputs), targets)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / grad_accum``; gradients sync only on the last micro-step."""
        self._mark_backward()
        self.precision.backward(loss / self.grad_accum if self.grad_accum > 1 else loss)
        self.phases.enter("optimizer")

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step the optimizer (and scheduler) at the end of an accumulation window.

        Returns:
            True when the optimizer stepped.
        """
        opt = optimizer or self.optimizer
        if opt is None and self.ps is None:
            raise ValueError("Job.step(): no optimizer given and none passed to setup()")
        # Micro-steps done in this window; back to 0 ends it (so does the epoch's last batch).
        self._micro = 0 if self._last_batch else (self._micro + 1) % self.grad_accum
        self._resume_point.stepped(pending=self._micro != 0)
        self._arm_sync()
        if self._micro:
            self.phases.enter("data")  # the next micro-batch
            return False
        self.phases.enter("optimizer")
        self._slow_down(self.step_count)
        if not self._ps_step():  # parameter servers step the optimizer (and the scheduler)
            assert opt is not None
            self.precision.step(opt)
            opt.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
        self.step_count += 1
        self._end_step()
        return True

    # ---- metrics and checkpoints -----------------------------------------------------------------
    def log(self, **metrics: float) -> dict[str, float]:
        """Average ``metrics`` over the ranks, write them (rank 0) and return the averages.

        Parameter-server workers are not in step with each other (one may be told to stop
        while another is mid-epoch), so there each worker returns its own values, without
        communication, and the first worker writes its own.
        """
        record = self.metrics.log_local if self.ps_config is not None else self.metrics.log
        averaged = record(self.step_count, **metrics)
        if self.metrics.is_writer:
            shown = " ".join(f"{k}={v:.4g}" for k, v in averaged.items())
            log.info("epoch %d step %d: %s", self.epoch, self.step_count, shown)
        return averaged

    def summary(self) -> dict[str, float]:
        """Samples/s over the job, and the share of this rank's time spent waiting for
        communication (``comm_share``, every strategy; :meth:`phase_shares` has each phase's)."""
        comm = self.phases.shares()["communication_share"]
        return {**self._timer.summary(self.world.world_size), "comm_share": comm}

    def close(self) -> None:
        """Flush metrics; leave the process group if the job created it."""
        self._finish_roles()
        self._close_phases()
        self.metrics.close()
        self.profiler.stop()
        if self.owns_group:
            pg.destroy_process_group()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
