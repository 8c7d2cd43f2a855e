"""Strategies by name: how the job API wraps a model for distributed training.

A strategy is a function ``wrap(model, world) -> nn.Module``, plus, for strategies that shard
optimizer state (ZeRO), ``optimizer(wrapped, optimizer, world) -> optimizer`` which rebuilds the
user's optimizer (same class and hyperparameters) in the strategy's form. Later strategies
(pipeline, tensor parallel, parameter server) register themselves here under their own names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from phalanx._check import FLAG, check_callable, check_str, checked, optional, rule
from phalanx.comm.group import World

__all__ = [
    "OptimizerHook",
    "Strategy",
    "get_optimizer_hook",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]

Strategy = Callable[[nn.Module, World], nn.Module]
OptimizerHook = Callable[[nn.Module, torch.optim.Optimizer, World], torch.optim.Optimizer]
_REGISTRY: dict[str, Strategy] = {}
_OPTIMIZERS: dict[str, OptimizerHook] = {}


@checked(
    name=rule(check_str),
    wrap=rule(check_callable, fix="wrap(model, world) -> the wrapped model"),
    optimizer=optional(rule(check_callable)),
    replace=FLAG,
)
def register_strategy(
    name: str, wrap: Strategy, *, optimizer: OptimizerHook | None = None, replace: bool = False
) -> None:
    """Make ``wrap`` (and optimizer rebuild ``optimizer``) available as ``Job(strategy=name)``."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"strategy {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = wrap
    _OPTIMIZERS.pop(name, None)
    if optimizer is not None:
        _OPTIMIZERS[name] = optimizer


def get_optimizer_hook(name: str) -> OptimizerHook | None:
    """How strategy ``name`` rebuilds the optimizer, or None when it keeps the user's."""
    get_strategy(name)
    return _OPTIMIZERS.get(name)


def strategy_names() -> list[str]:
    """Every registered strategy name, sorted."""
    return sorted(_REGISTRY)


def get_strategy(name: str) -> Strategy:
    """The wrap function registered as ``name``; the error lists the known names."""
    if name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not one of {', '.join(strategy_names())}")
    return _REGISTRY[name]


def _device_ids(world: World) -> list[int | torch.device] | None:
    return [world.device.index or 0] if world.device.type == "cuda" else None


def _ddp(model: nn.Module, world: World) -> nn.Module:
    from phalanx.data_parallel import DistributedDataParallel

    if world.world_size == 1:
        return model
    return DistributedDataParallel(model, device_ids=_device_ids(world))


def _torch_ddp(model: nn.Module, world: World) -> nn.Module:
    from phalanx.train.comm_timing import time_torch_ddp

    if world.world_size == 1:
        return model
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=_device_ids(world))
    return time_torch_ddp(ddp)  # its backward wait, for the phase clock


def _dp(model: nn.Module, world: World) -> nn.Module:
    from phalanx.data_parallel import DataParallel

    if world.world_size != 1:
        raise ValueError(
            f"strategy='dp' is single-process DataParallel but the job has "
            f"world_size={world.world_size}; use strategy='ddp' with `phalanx run`"
        )
    return DataParallel(model)


def _single(model: nn.Module, world: World) -> nn.Module:
    if world.world_size != 1:
        raise ValueError(f"strategy='single' needs world_size=1, got {world.world_size}")
    return model


def _configured_by_job(model: nn.Module, world: World) -> nn.Module:
    raise ValueError(
        "strategies 'pipeline' and 'tensor' split the model over dp x pp x tp groups: use "
        "Job(strategy=..., pp=..., tp=...), or phalanx.mesh.parallelize directly"
    )


register_strategy("ddp", _ddp)
register_strategy("pipeline", _configured_by_job)
register_strategy("tensor", _configured_by_job)
register_strategy("torch-ddp", _torch_ddp)
register_strategy("dp", _dp)
register_strategy("single", _single)


# Registering modules import this one, so they come last.
from phalanx.train import ps_strategies, zero_strategies  # noqa: E402,F401
