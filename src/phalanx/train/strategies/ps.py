"""``phalanx.PS(mode="sync"|"async"|"ssp")``: parameter servers inside the user's own loop.

The first ``servers`` ranks serve, the others train. On a server, ``job.epochs()`` and
``job.progress()`` serve until every worker has finished and then yield nothing; on a worker,
``job.progress()`` pulls the parameters before each batch and ``job.step()`` pushes the
gradients. The server runs the user's optimizer (rebuilt over its shard, same class and
options) and steps the scheduler after each of its optimizer steps.

The class is ``PS``, not ``ParameterServer``: that name is the low-level server/worker object
of :mod:`phalanx.parameter_server`, which this strategy drives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import FLAG, check_choice, check_int, optional, rule
from phalanx.comm import wait_clock
from phalanx.comm.group import World
from phalanx.parameter_server import ParameterServer
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
from phalanx.train.strategies.optimizers import rebuild_by_name
from phalanx.train.strategies.role import Role

__all__ = ["PS", "PSRunner"]

MODES = ("sync", "async", "ssp")


@dataclass(frozen=True)
class PS(Strategy):
    """Parameter servers: synchronous, asynchronous, or bounded staleness (SSP).

    Args:
        mode: "sync" (every worker's gradient per version), "async" or "ssp".
        servers: Server ranks (the first ones); the rest are workers.
        staleness: SSP's bound: a worker runs at most this many versions ahead of the slowest.
        staleness_lr: Scale each gradient by 1/(1+staleness) on the server.
        max_updates: Stop after this many server updates (an asynchronous budget).
    """

    name: ClassVar[str] = "ps"
    lockstep: ClassVar[bool] = False  # workers step on their own
    mode: str = "sync"
    servers: int = 1
    staleness: int | None = None
    staleness_lr: bool = False
    max_updates: int | None = None

    def __post_init__(self) -> None:
        check_fields(
            self,
            mode=rule(check_choice, choices=MODES),
            servers=rule(check_int, min=1),
            staleness=optional(rule(check_int, min=0)),
            staleness_lr=FLAG,
            max_updates=optional(rule(check_int, min=1)),
        )
        if self.mode == "ssp" and self.staleness is None:
            raise ValueError(
                "PS(mode='ssp') needs a staleness bound: phalanx.PS(mode='ssp', staleness=2)"
            )
        if self.mode != "ssp" and self.staleness is not None:
            raise ValueError(
                f"PS(staleness={self.staleness}) applies to mode='ssp', not mode={self.mode!r}"
            )

    def start(self, world: World, job: JobOptions) -> Runner:
        """Check the servers leave workers, no checkpoint directory and no fp16.

        Raises:
            ValueError: no rank left for workers, a checkpoint directory (servers do not
                checkpoint yet) or fp16 (workers would push loss-scaled gradients).
        """
        if not self.servers < world.world_size:
            raise ValueError(
                f"PS(mode={self.mode!r}, servers={self.servers}) needs more ranks than servers, "
                f"the job has world_size={world.world_size}"
            )
        if job.checkpoint_dir is not None:
            raise ValueError(
                f"checkpoint_dir={str(job.checkpoint_dir)!r}: parameter-server strategies do not "
                f"checkpoint yet (the state lives on the servers); drop checkpoint_dir"
            )
        if job.precision == "fp16-mixed":
            raise ValueError(
                "precision='fp16-mixed' with a parameter server: workers would push loss-scaled "
                "gradients; use precision='bf16-mixed' or 'fp32'"
            )
        return PSRunner(self, world)


class PSRole(Role):
    """A parameter-server job's rank: a server (serves until every worker has finished) or a
    worker (trains on its own, not in step with the other workers)."""

    def __init__(self, world: World, servers: int) -> None:
        self.world, self.servers = world, servers
        self.is_server = world.rank < servers
        self.server: ParameterServer | None = None
        """The server (on server ranks) or client (on workers) of this rank; set by setup."""
        self.done = False
        self.workers: dist.ProcessGroup | None = None
        """The workers' group (made by :meth:`metrics_group`, which ``Job()`` calls)."""

    def serving(self) -> bool:
        if self.server is None:
            return False
        if self.is_server and not self.done:  # serve once, until every worker has finished
            self.report = self.server.serve()
            self.done = True
        return self.done

    def before_batch(self) -> bool:
        """Worker ranks: fresh parameters for the next batch; False (and done) when stopped."""
        if self.server is None:
            return True
        with wait_clock.blocked():  # the servers' answer is communication wait
            if self.done or not self.server.pull():
                self.finish()
                return False
        return True

    def finished(self) -> bool:
        return self.done

    def finish(self) -> None:
        """Worker ranks: leave and load the final parameters (once)."""
        if self.server is not None and not self.done and not self.is_server:
            self.done = True
            self.server.close()

    def participants(self, world: World) -> tuple[int, int] | None:
        """Workers only: servers do not compute steps."""
        index = world.rank - self.servers
        return (world.world_size - self.servers, index) if index >= 0 else None

    def metrics_group(self) -> dist.ProcessGroup | None:
        """The workers' group (servers do not log); every rank calls this, in the same order."""
        self.workers = dist.new_group(list(range(self.servers, self.world.world_size)))
        return self.workers

    def logs_in_step(self) -> bool:
        # Workers are not in step (one may be told to stop while another is mid-epoch).
        return False

    def progress_rank(self) -> int:
        return self.servers

    def peer_sets(self) -> Iterable[list[int]] | None:
        # Workers are not in step: a collective among them would re-couple them.
        return []


class PSRunner(Runner):
    """This rank's parameter-server strategy inside a :class:`phalanx.Job`; its
    :class:`PSRole` serves or trains."""

    def __init__(self, strategy: PS, world: World) -> None:
        super().__init__(strategy, world)
        self.options = strategy
        self.role: PSRole = PSRole(world, strategy.servers)
        self.scheduler: Scheduler | None = None

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        loss_fn: LossFn | None,
        precision: Precision,
    ) -> Prepared:
        """Build this rank's role; the optimizer (and scheduler) now run on the servers."""
        from phalanx.train.loop_helpers import repoint

        if optimizer is None:
            raise ValueError(
                "parameter-server strategies run the optimizer on the servers: pass it to "
                "Job.setup(model, optimizer)"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        self.scheduler = scheduler

        def make_optimizer(params: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
            opt = rebuild_by_name(optimizer, names, params)
            if scheduler is not None:
                repoint(scheduler, opt)
            return opt

        # The parameter server speaks over gloo; with NCCL for the model, a gloo group of all.
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        o = self.options
        if o.servers > 1:  # each server serves its shard of its own build (seed=None)
            start_from_rank0(model)
        self.role.server = ParameterServer(
            model,
            make_optimizer,
            group,
            num_servers=o.servers,
            mode=o.mode,
            bound=o.staleness,
            staleness_lr=o.staleness_lr,
            max_updates=o.max_updates,
            on_version=self._on_version if scheduler is not None else None,
        )
        precision.wrap_forward(model)
        self.model = model
        return Prepared(model, optimizer, None, None, loss_fn)

    def _on_version(self, version: int, flat: torch.Tensor) -> None:
        assert self.scheduler is not None
        self.scheduler.step()

    def step(self, optimizer: torch.optim.Optimizer | None, precision: Precision) -> bool:
        """Push the gradients to the servers (which step the optimizer and the scheduler)."""
        assert self.role.server is not None and self.model is not None
        with wait_clock.blocked():
            self.role.server.push()
        self.model.zero_grad(set_to_none=True)
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        raise ValueError(
            f"Job.clip_grad_norm_() with strategy PS(mode={self.options.mode!r}): workers push "
            f"their own gradients and the servers apply them, so there is no whole gradient to "
            f"clip (clipping on the servers is not supported); drop the clip or use "
            f"phalanx.DDP() / phalanx.Zero()"
        )

    def check_schedule(self, schedule: str) -> None:
        if schedule != "step":
            raise ValueError(
                f"Job.setup(schedule={schedule!r}) with strategy PS(mode={self.options.mode!r}): "
                f"the servers step the scheduler after each of their optimizer steps; use "
                f"schedule='step'"
            )

    def data_shard(self) -> tuple[int, int]:
        """(workers, this worker) for a parameter-server job's data shards."""
        workers = self.world.world_size - self.options.servers
        return workers, max(0, self.world.rank - self.options.servers)

    def replica_group(self) -> dist.ProcessGroup | None:
        """The workers' group."""
        return self.role.workers
