"""``phalanx.Mesh(dp=, pp=, tp=, ...)``: a model split over a dp x pp x tp mesh of ranks.

    Job(phalanx.Mesh(pp=2, micro_batches=4, schedule="1f1b"))   # dp = world / pp
    Job(phalanx.Mesh(tp=2))                                      # dp = world / tp
    Job(phalanx.Mesh(pp=2, tp=2))                                # dp x pp x tp

Unlike the data-parallel strategies, these replace parameters (tensor parallel shards them) and
drop the ones other stages own (pipeline), so the user's optimizer is rebuilt — same class,
parameter groups and options — over this rank's parameters, matched by name. The presets
"pipeline" and "tensor" give every rank the others leave to that degree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm.group import World
from phalanx.mesh import ParallelConfig, ParallelGroups, ParallelModel, make_groups, parallelize
from phalanx.mesh.topology import Topology
from phalanx.train.grad_scaler import GradShards
from phalanx.train.precision import Precision
from phalanx.train.strategies.base import (
    JobOptions,
    LossFn,
    Prepared,
    Runner,
    Scheduler,
    Strategy,
)
from phalanx.train.strategies.initial_state import start_from_rank0
from phalanx.train.strategies.optimizers import rebuild_by_name
from phalanx.train.strategies.role import Role

__all__ = ["Mesh", "MeshRunner", "default_loss"]


@dataclass(frozen=True)
class Mesh(ParallelConfig, Strategy):
    """Tensor parallel, then pipeline, then data parallel over the rest (torchtitan's order).

    The options are :class:`~phalanx.mesh.ParallelConfig`'s, checked there:

    Args:
        dp: Data-parallel degree. One of ``dp``, ``pp``, ``tp`` may be None: the ranks the
            others leave (by default dp).
        pp: Pipeline-parallel degree.
        tp: Tensor-parallel degree.
        micro_batches: Micro-batches per step of a pipeline (must divide the batch).
        schedule: Pipeline schedule: "gpipe", "1f1b", "interleaved" or "zbh1" (zero bubble).
        chunks: Model chunks per pipeline rank (interleaved schedule).
        balance: Layers per pipeline stage, or "params" / "time".
        tp_plan: Module name -> "colwise" / "rowwise" / ...; GPT models have a default.
    """

    name: ClassVar[str] = "mesh"

    def config(self, world_size: int) -> ParallelConfig:
        """The split on ``world_size`` ranks, checked (errors name every degree)."""
        return self.for_world(world_size)

    def start(self, world: World, job: JobOptions) -> Runner:
        config = self.config(world.world_size)
        topology = config.topology(world.world_size)
        if topology.pp > 1 and job.grad_accum > 1:
            raise ValueError(
                f"grad_accum={job.grad_accum} with a pipeline (pp={topology.pp}): the pipeline "
                f"already accumulates over micro_batches={config.micro_batches}; raise that "
                f"instead"
            )
        if topology.pp > 1 and job.precision == "fp16-mixed":
            raise ValueError(
                f"precision='fp16-mixed' with a pipeline (pp={topology.pp}): the pipeline's "
                f"schedule runs its own backward, without the fp16 loss scaler; use "
                f"precision='bf16-mixed', or pp=1"
            )
        return MeshRunner(self, world, config, make_groups(topology))


def default_loss(model: nn.Module, groups: ParallelGroups) -> LossFn | None:
    """A GPT's language-model loss on (B, T, V) logits, vocabulary-parallel over ``groups.tp``
    (the default tensor-parallel plan keeps the head's logits sharded); None for other models."""
    from phalanx.models import GPT

    if not isinstance(model, GPT):
        return None
    from phalanx.tensor_parallel import vocab_parallel_cross_entropy

    return partial(
        vocab_parallel_cross_entropy, group=groups.tp, vocab_size=model.config.vocab_size
    )


class StageRole(Role):
    """Every rank trains in step; a pipeline's stages do different work."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def peer_sets(self) -> Iterable[list[int]] | None:
        """With a pipeline, the ranks of each stage (for the straggler monitor); else all."""
        if self.topology.pp == 1:
            return None
        stages = dict[int, list[int]]()
        for r in range(self.topology.world_size):
            stages.setdefault(self.topology.coords(r)["pp"], []).append(r)
        return list(stages.values())


class MeshRunner(Runner):
    """A split model at work: its schedule is the forward and backward; per-rank checkpoints."""

    def __init__(
        self, strategy: Mesh, world: World, config: ParallelConfig, groups: ParallelGroups
    ) -> None:
        super().__init__(strategy, world)
        self.config = config
        self.groups: ParallelGroups = groups
        """Process groups along dp / pp / tp."""
        self.role = StageRole(groups.topology)
        self.parallel: ParallelModel | None = None

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Scheduler | None,
        loss_fn: LossFn | None,
        precision: Precision,
    ) -> Prepared:
        """Split ``model`` as the config says and rebuild ``optimizer`` over this rank's share."""
        from phalanx.pipeline import Pipeline
        from phalanx.train.loop_helpers import repoint

        config = self.config
        loss_fn = loss_fn or default_loss(model, self.groups)
        if loss_fn is None:
            raise ValueError(
                f"strategy with pp={config.pp}, tp={config.tp} needs Job.setup(model, optimizer, "
                f"loss_fn=...) for a {type(model).__name__}: the loss is computed inside the "
                f"parallel step (on the last pipeline stage)"
            )
        if self.groups.topology.tp > 1:  # each rank slices its shards from its own build
            start_from_rank0(model)
        names = {id(p): name for name, p in model.named_parameters()}
        parallel = parallelize(model, self.groups, config, loss_fn)
        # Autocast where the forward runs: around each local pipeline chunk, or the whole model.
        pipe = parallel.module
        parts = list(pipe.stages) if isinstance(pipe, Pipeline) else [parallel]
        for part in parts:
            precision.wrap_forward(part)
        if optimizer is not None:
            # Names are taken from the (tensor-parallelised, in place) model; the pipeline keeps
            # a subset of those very parameter objects.
            kept = {id(p) for p in parallel.parameters()}
            local = {n: p for n, p in model.named_parameters() if id(p) in kept}
            optimizer = rebuild_by_name(optimizer, names, local)
            if scheduler is not None:
                repoint(scheduler, optimizer)
        self.parallel, self.model, self.optimizer = parallel, parallel, optimizer
        return Prepared(parallel, optimizer, optimizer, scheduler, loss_fn)

    def attach_phases(self, enter: Callable[[str | None], None]) -> None:
        """A pipeline marks forward and backward per action of its schedule."""
        from phalanx.pipeline import Pipeline

        if self.parallel is not None and isinstance(self.parallel.module, Pipeline):
            self.parallel.module.on_action = enter

    def require_backward_grad_sync(self, sync: bool) -> None:
        if self.parallel is not None:
            self.parallel.require_backward_grad_sync = sync

    def data_shard(self) -> tuple[int, int]:
        # Ranks of one replica (its pipeline stages, its tensor shards) read the same samples.
        return self.groups.topology.dp, self.groups.index("dp")

    def replica_group(self) -> dist.ProcessGroup | None:
        return self.groups.dp

    def forward_backward(
        self,
        inputs: object,
        targets: object,
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        assert self.parallel is not None
        if not self.parallel.pipelined:
            return super().forward_backward(inputs, targets, loss_fn, backward)
        return self.parallel.train_step(inputs, targets)  # the whole schedule, every stage

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Over the whole model: summed over stages and tensor shards (``mesh/clip.py``)."""
        assert self.parallel is not None
        return self.parallel.clip_grad_norm_(max_norm, norm_type)

    def grad_shards(self, optimizer: torch.optim.Optimizer) -> GradShards | None:
        """fp16: tensor shards (and pipeline stages, which refuse fp16 for now) hold different
        gradients, so overflows are agreed over every rank: one all-reduce of one flag
        (data-parallel replicas hold equal, averaged gradients anyway)."""
        agree = self.groups.topology.tp * self.groups.topology.pp > 1
        return GradShards(optimizer, agree) if agree else None

    def checkpointed(self, saving: bool) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
        """Per-rank pieces keyed by the unsplit model's names (``mesh/checkpoint.py``)."""
        assert self.parallel is not None
        views = self.parallel.checkpoint_views(self.optimizer)
        # checkpoint.save / load take these sharded views where they take a model / optimizer
        return cast(tuple[nn.Module, torch.optim.Optimizer | None], views)
