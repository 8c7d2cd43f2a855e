"""ZeRO strategies for the job API: "zero1", "zero2", "zero3" and torch's "torch-zero1",
"torch-fsdp" baselines.

The user builds a plain ``torch.optim`` optimizer over the unwrapped model; the strategy
rebuilds it (same class, parameter groups and hyperparameters) in its sharded form, and a
scheduler given to ``Job.setup`` is re-pointed at the new optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from phalanx.comm.group import World
from phalanx.train.comm_timing import time_torch_fsdp, time_torch_zero
from phalanx.train.strategies import _torch_ddp, register_strategy

__all__ = ["unit_policy"]


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _accepted(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``cls``'s constructor takes (``defaults`` holds a few it does not,
    e.g. AdamW's ``decoupled_weight_decay``; the parameter groups keep those)."""
    names = inspect.signature(cls).parameters
    return {k: v for k, v in options.items() if k in names}


def _rebuild_one_group(
    opt: torch.optim.Optimizer, params: Any, strategy: str
) -> torch.optim.Optimizer:
    options = _one_group(opt, strategy)
    new = type(opt)(params, **_accepted(type(opt), options))
    new.param_groups[0].update(options)
    return new


def _zero(stage: int) -> Any:
    def rebuild(
        model: nn.Module, opt: torch.optim.Optimizer, world: World
    ) -> torch.optim.Optimizer:
        from phalanx.sharding import ZeroRedundancyOptimizer

        groups = [{**_options(g), "params": g["params"]} for g in opt.param_groups]
        defaults = _accepted(type(opt), opt.defaults)
        return ZeroRedundancyOptimizer(
            groups, type(opt), parameters_as_bucket_view=True, stage=stage, **defaults
        )

    return rebuild


def _same(model: nn.Module, world: World) -> nn.Module:
    return model


def unit_policy(model: nn.Module) -> set[nn.Module]:
    """The submodules ZeRO-3 shards as units of their own: each element of a ``ModuleList``
    (transformer blocks and the like); without one, each top-level child holding parameters."""
    units = {
        m
        for ml in model.modules()
        if isinstance(ml, nn.ModuleList)
        for m in ml
        if any(True for _ in m.parameters())
    }
    if not units:
        units = {m for m in model.children() if any(True for _ in m.parameters())}
    return units


def _one_group(opt: torch.optim.Optimizer, strategy: str) -> dict[str, Any]:
    options = [_options(g) for g in opt.param_groups]
    if any(o != options[0] for o in options[1:]):
        raise ValueError(
            f"strategy={strategy!r} shards whole units, so every parameter shares one set of "
            f"optimizer options; got {len(options)} parameter groups with different options "
            f"(use strategy='zero2' to keep per-group options)"
        )
    return options[0]


def _zero3(model: nn.Module, world: World) -> nn.Module:
    from phalanx.sharding.zero3 import FullyShardedDataParallel

    units = unit_policy(model)
    return FullyShardedDataParallel(model, wrap=lambda m: m in units)


def _zero3_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, world: World
) -> torch.optim.Optimizer:
    from phalanx.sharding.zero import check_elementwise

    check_elementwise(type(opt))
    return _rebuild_one_group(opt, model.parameters(), "zero3")


def _torch_zero1(model: nn.Module, world: World) -> nn.Module:
    return _torch_ddp(model, world)


def _torch_zero1_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, world: World
) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{**_options(g), "params": g["params"]} for g in opt.param_groups]
    defaults = _accepted(type(opt), opt.defaults)
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)
    return time_torch_zero(zero)


def _torch_fsdp(model: nn.Module, world: World) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for unit in unit_policy(model):
        fully_shard(unit)
    fully_shard(model)
    return time_torch_fsdp(model)


def _torch_fsdp_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, world: World
) -> torch.optim.Optimizer:
    return _rebuild_one_group(opt, model.parameters(), "torch-fsdp")


register_strategy("zero1", _same, optimizer=_zero(1))
register_strategy("zero2", _same, optimizer=_zero(2))
register_strategy("zero3", _zero3, optimizer=_zero3_optimizer)
register_strategy("torch-zero1", _torch_zero1, optimizer=_torch_zero1_optimizer)
register_strategy("torch-fsdp", _torch_fsdp, optimizer=_torch_fsdp_optimizer)
