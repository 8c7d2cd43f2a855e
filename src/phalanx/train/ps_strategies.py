"""Job strategies "ps-sync", "ps-async", "ssp" and "hogwild".

Parameter-server strategies turn the job's ranks into servers (the first ``servers`` ranks)
and workers. The training loop stays the user's: on a server, ``job.epochs()`` and
``job.progress()`` serve until every worker has finished and then yield nothing; on a worker,
``job.progress()`` pulls the parameters before each batch and ``job.step()`` pushes the
gradients. The server runs the user's optimizer (rebuilt over its shard, same class and
options) and steps the scheduler after each of its optimizer steps.

"hogwild" shares the parameters of every rank on one machine (lock-free, no communication):
each rank steps its own optimizer on the shared weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.comm.group import World
from phalanx.parameter_server import ParameterServer, ServerReport
from phalanx.train.strategies import register_strategy

__all__ = ["PS_MODES", "PSConfig", "PSRunner", "ps_config"]

PS_MODES = {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}


@dataclass(frozen=True)
class PSConfig:
    """A parameter-server job's settings, checked against the world size."""

    mode: str
    servers: int = 1
    staleness: int | None = None
    staleness_lr: bool = False
    max_updates: int | None = None


def ps_config(
    strategy: str,
    world_size: int,
    *,
    servers: int | None,
    staleness: int | None,
    staleness_lr: bool,
    max_updates: int | None,
    checkpoint_dir: Any = None,
    precision: str = "fp32",
) -> PSConfig | None:
    """The parameter-server settings of ``strategy``; None for other strategies.

    Raises:
        ValueError: for parameter-server options with another strategy, ``ssp`` without a
            staleness bound, no rank left for workers, a checkpoint directory (servers do
            not checkpoint yet) or fp16 (workers would push loss-scaled gradients).
    """
    given = {"servers": servers, "staleness": staleness, "max_updates": max_updates}
    if strategy not in PS_MODES:
        extra = {k: v for k, v in given.items() if v is not None}
        if extra or staleness_lr:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in extra.items()) or 'staleness_lr=True'} "
                f"applies to strategies {sorted(PS_MODES)}, not strategy={strategy!r}"
            )
        return None
    mode = PS_MODES[strategy]
    if mode == "ssp" and staleness is None:
        raise ValueError("strategy='ssp' needs a staleness bound: Job(strategy='ssp', staleness=2)")
    if mode != "ssp" and staleness is not None:
        raise ValueError(f"staleness={staleness} applies to strategy='ssp', not {strategy!r}")
    servers = 1 if servers is None else servers
    if not 1 <= servers < world_size:
        raise ValueError(
            f"strategy={strategy!r} with servers={servers} needs more ranks than servers, "
            f"the job has world_size={world_size}"
        )
    if checkpoint_dir is not None:
        raise ValueError(
            f"checkpoint_dir={str(checkpoint_dir)!r}: parameter-server strategies do not "
            f"checkpoint yet (the state lives on the servers); drop checkpoint_dir"
        )
    if precision == "fp16":
        raise ValueError(
            "precision='fp16' with a parameter server: workers would push loss-scaled "
            "gradients; use precision='bf16' or 'fp32'"
        )
    return PSConfig(mode, servers, staleness, staleness_lr, max_updates)


class PSRunner:
    """This rank's parameter-server role inside a :class:`phalanx.Job`."""

    def __init__(
        self,
        config: PSConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
    ) -> None:
        from phalanx.train.loop_helpers import repoint
        from phalanx.train.parallel_strategies import rebuild_optimizer

        names = {id(p): n for n, p in model.named_parameters()}
        self.scheduler = scheduler

        def make_optimizer(params: dict[str, nn.Parameter]) -> torch.optim.Optimizer:
            opt = rebuild_optimizer(optimizer, names, params)
            if scheduler is not None:
                repoint(scheduler, opt)
            return opt

        import torch.distributed as dist

        # The parameter server speaks over gloo; with NCCL for the model, a gloo group of all.
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.ps = ParameterServer(
            model,
            make_optimizer,
            group,
            num_servers=config.servers,
            mode=config.mode,
            bound=config.staleness,
            staleness_lr=config.staleness_lr,
            max_updates=config.max_updates,
            on_version=self._on_version if scheduler is not None else None,
        )
        self.report: ServerReport | None = None
        self.done = False

    @property
    def is_server(self) -> bool:
        """True on server ranks."""
        return self.ps.is_server

    def _on_version(self, version: int, flat: torch.Tensor) -> None:
        self.scheduler.step()

    def serve(self) -> None:
        """Server ranks: serve once, until every worker has finished."""
        if self.is_server and not self.done:
            self.report = self.ps.serve()
            self.done = True

    def pull(self) -> bool:
        """Worker ranks: fresh parameters for the next batch; False (and done) when stopped."""
        if self.done or not self.ps.pull():
            self.finish()
            return False
        return True

    def finish(self) -> None:
        """Worker ranks: leave and load the final parameters (once)."""
        if not self.done and not self.is_server:
            self.done = True
            self.ps.close()


def _ps_wrap(model: nn.Module, world: World) -> nn.Module:
    return model  # the runner is built in Job.setup, where the optimizer is known


def _hogwild(model: nn.Module, world: World) -> nn.Module:
    from phalanx.hogwild.shared import share_parameters

    if world.local_world_size != world.world_size:
        raise ValueError(
            f"strategy='hogwild' shares memory within one machine, but the job has "
            f"world_size={world.world_size} over several nodes (local_world_size="
            f"{world.local_world_size}); use 'ps-async' across machines"
        )
    if world.world_size > 1:
        share_parameters(model)
    return model


for _name in PS_MODES:
    register_strategy(_name, _ps_wrap)
register_strategy("hogwild", _hogwild)
