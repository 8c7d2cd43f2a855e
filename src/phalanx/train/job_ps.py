"""The parameter-server and deliberate-straggler hooks of :class:`phalanx.Job`.

Kept apart from ``job.py`` so the data-parallel loop reads without them: the job calls
:meth:`PSMixin._before_batch` before yielding a batch and :meth:`PSMixin._ps_step` instead of
stepping a local optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import wait_clock
from phalanx.comm.group import World
from phalanx.train.ps_strategies import PSConfig, PSRunner
from phalanx.train.straggler import Straggler

__all__ = ["PSMixin"]


class PSMixin:
    """Parameter-server roles and the straggler option for :class:`phalanx.Job`."""

    world: World
    seed: int
    ps_config: PSConfig | None
    ps: PSRunner | None
    straggler: Straggler | None
    metrics: Any
    model: Any
    optimizer: Any
    scheduler: Any
    precision: Any
    step_count: int

    def _init_roles(self, straggler: tuple[int | str, float] | None) -> None:
        self.ps = None
        self.straggler = None
        if straggler is None:
            return
        who, factor = straggler
        count, index = self.world.world_size, self.world.rank
        if self.ps_config is not None:  # workers only: servers do not compute steps
            count = self.world.world_size - self.ps_config.servers
            index = self.world.rank - self.ps_config.servers
            if index < 0:
                return
        self.straggler = Straggler(factor, who, index=index, count=count, seed=self.seed)

    def _worker_group(self) -> dist.ProcessGroup | None:
        """The workers' group (metrics average over it: servers do not log); None without
        parameter servers. Every rank must call this, in the same order."""
        if self.ps_config is None:
            return None
        return dist.new_group(list(range(self.ps_config.servers, self.world.world_size)))

    def _draws_progress(self) -> bool:
        """The progress bar is drawn by rank 0, or by the first worker of a parameter server."""
        return self.world.rank == (self.ps_config.servers if self.ps_config else 0)

    def _setup_ps(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Build this rank's role; the optimizer (and scheduler) now run on the servers."""
        assert self.ps_config is not None
        if optimizer is None:
            raise ValueError(
                "parameter-server strategies run the optimizer on the servers: pass it to "
                "Job.setup(model, optimizer)"
            )
        self.ps = PSRunner(self.ps_config, model, optimizer, scheduler)
        self.precision.wrap_forward(model)
        self.model, self.optimizer, self.scheduler = model, None, None
        return model, optimizer

    @property
    def is_server(self) -> bool:
        """True on a parameter-server rank (which serves instead of training)."""
        return self.ps is not None and self.ps.is_server

    def _replicas(self) -> tuple[int, int] | None:
        """(workers, this worker) for a parameter-server job's data shards."""
        if self.ps_config is None:
            return None
        workers = self.world.world_size - self.ps_config.servers
        return workers, max(0, self.world.rank - self.ps_config.servers)

    def _serving(self) -> bool:
        """Serve (once) on a server rank; True when this rank has no batches to train on."""
        if self.ps is None:
            return False
        if self.ps.is_server:
            self.ps.serve()
        return self.ps.done

    def _before_batch(self) -> bool:
        """Pull fresh parameters (parameter servers) and start the step's clock; False: stop."""
        if self.ps is not None:
            with wait_clock.blocked():  # the servers' answer is communication wait
                if not self.ps.pull():
                    return False
        if self.straggler is not None:
            self.straggler.begin()
        return True

    def _slow_down(self, step: int) -> None:
        if self.straggler is not None:
            self.straggler.end(step)

    def _ps_step(self) -> bool:
        """Push the gradients to the parameter servers; False when the job has none."""
        if self.ps is None:
            return False
        with wait_clock.blocked():
            self.ps.ps.push()
        self.model.zero_grad(set_to_none=True)
        return True

    def _finish_roles(self) -> None:
        if self.ps is not None:
            self.ps.finish()
