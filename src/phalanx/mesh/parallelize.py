"""Compose tensor, pipeline and data parallelism in one documented order.

:func:`parallelize` applies, as torchtitan's ``parallelize`` and Megatron-LM do:

1. **tensor parallel** on the ``tp`` group: the plan's Linear / Embedding layers are replaced
   in place by their sharded versions (so later steps see the sharded parameters);
2. **pipeline split** on the ``pp`` group: the model's ordered layers (``model.stages()``, or the
   children of an ``nn.Sequential``) are cut into stages and this rank keeps only its own;
3. **data parallel** on the ``dp`` group: without a pipeline, phalanx DDP (bucketed all-reduce
   overlapping backward); with one, the stage's accumulated gradients are averaged after the
   schedule ran (a stage runs m backwards per step, which DDP's one-backward hooks cannot follow).

Replicas start equal: DDP broadcasts from the first replica, and the pipeline path does the same
over ``dp`` before training.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx.mesh.checkpoint import ParallelModelState, ParallelOptimizerState, plan_pieces
from phalanx.mesh.config import ParallelConfig
from phalanx.mesh.groups import ParallelGroups
from phalanx.mesh.replica_average import average_gradients

__all__ = ["ParallelModel", "layers_of", "parallelize"]

LossFn = Callable[[Any, Any], torch.Tensor]


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The ordered layers a pipeline cuts: ``model.stages()`` or an ``nn.Sequential``'s children."""
    stages = getattr(model, "stages", None)
    if callable(stages):
        return list(stages())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise TypeError(
        f"a pipeline needs the model's layers in order: give an nn.Sequential or a model with a "
        f"stages() method returning its layers (as phalanx.models.GPT has); got "
        f"{type(model).__name__}"
    )


class ParallelModel(nn.Module):
    """This rank's part of a dp x pp x tp model, trained one batch per :meth:`train_step`.

    ``parameters()`` are this rank's parameters only (its stage's, its tensor shards): build
    the optimizer over them.
    """

    def __init__(
        self,
        module: nn.Module,
        groups: ParallelGroups,
        loss_fn: LossFn,
        pipelined: bool,
        whole: nn.Module,
    ) -> None:
        super().__init__()
        self.module = module
        self.groups = groups
        self.loss_fn = loss_fn
        self.pipelined = pipelined
        self.__dict__["_whole"] = whole  # not a submodule: parameters() stays this rank's

    def checkpoint_views(
        self, optimizer: torch.optim.Optimizer | None
    ) -> tuple[ParallelModelState, ParallelOptimizerState | None]:
        """What ``phalanx.checkpoint.save`` / ``load`` take for this model and its optimizer:
        pieces keyed by the unsplit model's names, written once per replica group."""
        whole: nn.Module = self.__dict__["_whole"]
        first_replica = self.groups.index("dp") == 0
        layout, writes = plan_pieces(
            whole, {id(p) for p in self.module.parameters()}, self.groups.index("tp")
        )
        writes = writes if first_replica else set()
        local = {id(b) for b in self.module.buffers()}
        buffers = {n: b for n, b in whole.named_buffers() if id(b) in local}
        model = ParallelModelState(
            layout, writes, buffers, first_replica and self.groups.index("tp") == 0
        )
        opt = ParallelOptimizerState(optimizer, layout, writes) if optimizer is not None else None
        return model, opt

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (without a pipeline; use :meth:`evaluate` with one)."""
        if self.pipelined:
            raise RuntimeError(
                "ParallelModel: a pipelined model has no single-call forward; use train_step() "
                "to train and evaluate() for a loss without gradients"
            )
        return self.module(*args, **kwargs)

    def train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward of one batch; gradients end averaged over the dp group.

        Returns:
            The batch's mean loss (detached), on every rank of this replica.
        """
        if self.pipelined:
            loss = cast(Any, self.module).step(inputs, targets)
            loss = self._share_loss(loss)
            average_gradients(self.module.parameters(), self.groups.dp)
            return loss
        loss = self.loss_fn(self.module(inputs), targets)
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the whole model's gradient norm (summed over stages and tensor shards)."""
        from phalanx.mesh.clip import clip_grad_norm_

        return clip_grad_norm_(self.module, max_norm, self.groups, norm_type)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward averages gradients over dp (DDP's flag; ``Job`` sets it)."""
        return bool(getattr(self.module, "require_backward_grad_sync", True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if hasattr(self.module, "require_backward_grad_sync"):
            setattr(self.module, "require_backward_grad_sync", value)  # noqa: B010

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The mean loss of one batch without gradients, on every rank of this replica."""
        if self.pipelined:
            out = cast(Any, self.module).eval_step(inputs)
            loss = self.loss_fn(out, targets) if out is not None else None
            return self._share_loss(loss)
        return self.loss_fn(self.module(inputs), targets).detach()

    def _share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        # Only the last stage computed the loss; it travels to the other stages of the replica.
        group = self.groups.pp
        last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
        buf = torch.zeros((), device=_device_of(self.module))
        if loss is not None:
            buf.copy_(loss.detach())
        from phalanx.comm import collectives as C

        C.broadcast(buf, src=last, group=group)
        return buf


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _apply_tensor_parallel(
    model: nn.Module, plan: Mapping[str, str] | None, tp: int, group: Any
) -> None:
    from phalanx.tensor_parallel import gpt_plan, parallelize_module

    if plan is None:
        from phalanx.models import GPT

        if not isinstance(model, GPT):
            raise ValueError(
                f"tp={tp} needs a tensor-parallel plan for {type(model).__name__}: pass "
                f"tp_plan={{'module.name': 'colwise' | 'rowwise' | ...}} (only GPT has a default)"
            )
        plan = gpt_plan(model, tp=tp)  # validates heads and widths against tp
    parallelize_module(model, plan, group)


def _broadcast_parameters(module: nn.Module, group: Any) -> None:
    if dist.get_world_size(group) == 1:
        return
    from phalanx.comm import collectives as C

    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            C.broadcast(t, src=src, group=group)


def parallelize(
    model: nn.Module, groups: ParallelGroups, config: ParallelConfig, loss_fn: LossFn
) -> ParallelModel:
    """Split ``model`` over ``groups``: tensor parallel, then pipeline, then data parallel.

    Args:
        model: The whole model, built identically on every rank (same seed).
        groups: From :func:`phalanx.mesh.make_groups` for ``config.topology(world_size)``.
        config: Degrees, schedule, micro-batches and tensor-parallel plan.
        loss_fn: ``loss_fn(output, targets) -> scalar mean loss``. Under tensor parallel with a
            vocabulary-parallel head the output is this rank's vocabulary shard of the logits:
            use :func:`phalanx.tensor_parallel.vocab_parallel_cross_entropy` on ``groups.tp``.
    """
    topo = groups.topology
    if topo != config.topology(topo.world_size):
        raise ValueError(
            f"parallelize: groups were built for {topo.describe()} but the config asks for "
            f"dp={config.dp} x pp={config.pp} x tp={config.tp}"
        )
    if topo.tp > 1:
        _apply_tensor_parallel(model, config.tp_plan, topo.tp, groups.tp)
    if topo.pp > 1:
        from phalanx.pipeline import Pipeline

        pipe = Pipeline(
            layers_of(model),
            groups.pp,
            schedule=config.schedule,
            micro_batches=config.micro_batches,
            loss_fn=loss_fn,
            chunks=config.chunks,
            balance=config.balance,
        )
        _broadcast_parameters(pipe, groups.dp)
        return ParallelModel(pipe, groups, loss_fn, pipelined=True, whole=model)
    local: nn.Module = nn.Sequential(*layers_of(model)) if hasattr(model, "stages") else model
    if topo.dp > 1:
        from phalanx.data_parallel import DistributedDataParallel

        local = DistributedDataParallel(local, process_group=groups.dp)
    return ParallelModel(local, groups, loss_fn, pipelined=False, whole=model)
