"""``ParameterServer``: one object per rank that is either a server shard or a worker.

Group ranks ``0 .. num_servers - 1`` serve, the others work. Every rank builds the same shard
plan from the same model, so no plan is exchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import (
    FLAG,
    GROUP,
    MODULE,
    check_callable,
    check_choice,
    check_float,
    check_int,
    checked,
    optional,
    rule,
)
from phalanx.comm import collectives as c
from phalanx.comm.shm import GLOO_P2P
from phalanx.parameter_server.core import MODES, check_mode
from phalanx.parameter_server.server import MakeOptimizer, Server, ServerReport
from phalanx.parameter_server.shards import plan_shards
from phalanx.parameter_server.worker import Worker, WorkerHistory

__all__ = ["ParameterServer"]


def _check(world: int, num_servers: int, heartbeat: float, dead_after: float) -> None:
    """What depends on the group size and on two arguments at once."""
    if not num_servers < world:
        raise ValueError(
            f"num_servers={num_servers} with a group of {world} ranks: need 1 <= num_servers "
            f"< {world} so that at least one rank is a worker"
        )
    if dead_after <= heartbeat:
        raise ValueError(
            f"dead_after={dead_after} must exceed heartbeat={heartbeat}: a worker is lost "
            f"only after missing heartbeats"
        )


_seconds = rule(check_float, above=0)


class ParameterServer:
    """This rank's part of a parameter-server job over c10d point-to-point.

    On a server rank call :meth:`serve`; on a worker rank loop ``while ps.pull(): ...;
    ps.push()`` and finish with :meth:`close`. Afterwards every rank's ``model`` holds the final
    parameters (a server's only its own shard when there are several).

    Args:
        model: The model, built identically on every rank (same parameter names and shapes).
        make_optimizer: Builds a server's optimizer over its parameters (name -> parameter),
            e.g. ``lambda ps: torch.optim.SGD(ps.values(), lr=0.1)``.
        group: A gloo process group (default: the world). With NCCL for the model, create one
            with ``torch.distributed.new_group(backend="gloo")``; parameters and gradients
            cross it as CPU tensors, so the model itself may live on a GPU.
        num_servers: Server ranks, ``1 <= num_servers < group size``.
        mode: ``"sync"``, ``"async"`` or ``"ssp"`` (see :mod:`phalanx.parameter_server.core`).
        bound: Staleness bound ``s`` for ``"ssp"``; 0 behaves exactly like ``"sync"``.
        staleness_lr: Scale updates by ``1 / (1 + staleness)``.
        max_updates: Tell workers to stop once this many gradients were accepted.
        heartbeat: Seconds between worker heartbeats.
        dead_after: Seconds of silence after which a server declares a worker lost.
        on_version: Server ranks: called as ``on_version(version, flat_shard)`` per update.
    """

    @checked(
        model=MODULE,
        make_optimizer=rule(check_callable, fix="e.g. lambda ps: torch.optim.SGD(ps.values())"),
        group=GROUP,
        num_servers=rule(check_int, min=1),
        mode=rule(check_choice, choices=MODES),
        bound=optional(rule(check_int, min=0)),
        staleness_lr=FLAG,
        max_updates=optional(rule(check_int, min=1)),
        heartbeat=_seconds,
        dead_after=_seconds,
        on_version=optional(rule(check_callable)),
    )
    def __init__(
        self,
        model: nn.Module,
        make_optimizer: MakeOptimizer,
        group: dist.ProcessGroup | None = None,
        *,
        num_servers: int = 1,
        mode: str = "async",
        bound: int | None = None,
        staleness_lr: bool = False,
        max_updates: int | None = None,
        heartbeat: float = 1.0,
        dead_after: float = 5.0,
        on_version: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        assert self.group is not None
        backend = str(dist.get_backend(self.group))
        if backend not in GLOO_P2P:
            raise ValueError(
                f"ParameterServer needs a gloo (or shm) group (its messages are CPU tensors with "
                f"tags, received on one thread per worker), got backend {backend!r}: pass "
                f"group=torch.distributed.new_group(backend='gloo'); models may stay on the GPU"
            )
        check_mode(mode, bound)
        _check(dist.get_world_size(self.group), num_servers, heartbeat, dead_after)
        self.model, self.mode = model, mode
        named = dict(model.named_parameters())
        self.plan = plan_shards([(n, p.numel()) for n, p in named.items()], num_servers)
        rank = dist.get_rank(self.group)
        self.is_server = rank < num_servers
        self.num_workers = dist.get_world_size(self.group) - num_servers
        self.server: Server | None = None
        self.worker: Worker | None = None
        # Every rank of the group constructs together: a server counts a worker's silence from
        # the moment it starts serving, so a worker still far behind (a slow import, its data,
        # a loaded machine) would be declared lost before its heartbeats had begun.
        c.barrier(group=self.group)
        if self.is_server:
            self.server = Server(
                named,
                make_optimizer,
                self.plan,
                rank,
                self.group,
                mode=mode,
                bound=bound,
                staleness_lr=staleness_lr,
                max_updates=max_updates,
                heartbeat=heartbeat,
                dead_after=dead_after,
                on_version=on_version,
            )
        else:
            self.worker = Worker(model, self.plan, self.group, heartbeat=heartbeat)

    @property
    def worker_index(self) -> int | None:
        """This rank's worker index, None on a server."""
        return None if self.worker is None else self.worker.index

    def serve(self) -> ServerReport:
        """Server ranks: serve until every worker finished; the model gets this shard's result."""
        if self.server is None:
            raise ValueError("ParameterServer.serve() on a worker rank; call pull()/push()")
        report = self.server.serve()
        self.server.load_into(self.model)
        return report

    def pull(self) -> bool:
        """Worker ranks: load the parameters for the next step; False when told to stop."""
        return self._worker("pull").pull()

    def push(self) -> None:
        """Worker ranks: send this step's gradients."""
        self._worker("push").push()

    def close(self, final: bool = True) -> None:
        """Worker ranks: finish; with ``final`` load the final parameters into the model."""
        self._worker("close").close(final)

    @property
    def history(self) -> WorkerHistory:
        """Worker ranks: the (clock, version) of every pull."""
        return self._worker("history").history

    def _worker(self, op: str) -> Worker:
        if self.worker is None:
            raise ValueError(f"ParameterServer.{op}() on a server rank; call serve()")
        return self.worker
