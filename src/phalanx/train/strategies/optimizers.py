"""Rebuilding the user's optimizer in a strategy's form: same class, parameter groups, options.

The user builds a plain ``torch.optim`` optimizer over the unwrapped model; a sharding strategy
(ZeRO, FSDP) or a split model (pipeline, tensor parallel, parameter servers) rebuilds it over
what this rank holds, and a scheduler given to ``Job.setup`` is re-pointed at the rebuild.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["accepted", "options", "rebuild_by_name", "rebuild_one_group", "unit_policy"]


# Parameter groups and defaults are torch's ``dict[str, Any]``.


def options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's options (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def accepted(cls: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options ``cls``'s constructor takes (``defaults`` holds a few it does not, e.g.
    AdamW's ``decoupled_weight_decay``; the parameter groups keep those)."""
    names = inspect.signature(cls).parameters
    return {k: v for k, v in given.items() if k in names}


def _one_group(opt: torch.optim.Optimizer, strategy: str) -> dict[str, Any]:
    found = [options(g) for g in opt.param_groups]
    if any(o != found[0] for o in found[1:]):
        raise ValueError(
            f"strategy={strategy!r} shards whole units, so every parameter shares one set of "
            f"optimizer options; got {len(found)} parameter groups with different options "
            f"(use strategy='zero2' to keep per-group options)"
        )
    return found[0]


def rebuild_one_group(
    opt: torch.optim.Optimizer, params: Iterable[nn.Parameter], strategy: str
) -> torch.optim.Optimizer:
    """``opt``'s class and (single set of) options over ``params``."""
    found = _one_group(opt, strategy)
    new = type(opt)(params, **accepted(type(opt), found))
    new.param_groups[0].update(found)
    return new


def rebuild_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], local: Mapping[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """``optimizer``'s class, groups and options over ``local`` (parameter name -> parameter).

    Args:
        optimizer: Built over the whole model before it was split.
        names: ``id(parameter) -> name`` of the whole model's parameters at that time.
        local: The parameters this rank keeps, by the same names (new objects where sharded).
    """
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"Job.setup: the optimizer holds {len(unknown)} parameter(s) that are not the "
                f"model's; build it over model.parameters() before Job.setup"
            )
        params = [local[names[id(p)]] for p in group["params"] if names[id(p)] in local]
        groups.append({**options(group), "params": params})
    cls = type(optimizer)
    # Empty groups stay (a stage may hold none of a group's parameters), so every rank has the
    # same groups by index: checkpoints keep per-group options that way.
    return cls(groups, **accepted(cls, optimizer.defaults))


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
