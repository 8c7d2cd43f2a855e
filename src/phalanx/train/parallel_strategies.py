"""The job API's model-parallel strategies: "pipeline" and "tensor", with dp x pp x tp degrees.

    Job(strategy="pipeline", pp=2, micro_batches=4, schedule="1f1b")   # dp = world / pp
    Job(strategy="tensor", tp=2)                                       # dp = world / tp
    Job(strategy="pipeline", pp=2, tp=2)                               # dp x pp x tp

Unlike the data-parallel strategies, these replace parameters (tensor parallel shards them) and
drop the ones other stages own (pipeline), so the user's optimizer is rebuilt — same class,
parameter groups and options — over this rank's parameters, matched by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from phalanx.mesh import ParallelConfig, ParallelGroups, ParallelModel, parallelize
from phalanx.mesh.parallelize import LossFn
from phalanx.train.precision import Precision

__all__ = [
    "PARALLEL_STRATEGIES",
    "default_loss",
    "parallel_config",
    "rebuild_optimizer",
    "setup_parallel",
]

PARALLEL_STRATEGIES = ("pipeline", "tensor")


def parallel_config(
    strategy: str,
    world_size: int,
    *,
    dp: int | None,
    pp: int | None,
    tp: int | None,
    micro_batches: int,
    schedule: str,
    chunks: int,
    balance: Sequence[int] | str | None,
    tp_plan: Mapping[str, str] | None,
) -> ParallelConfig | None:
    """The split ``Job(strategy=..., dp=, pp=, tp=, ...)`` asks for, validated; None for others.

    The strategy's own degree defaults to what the others leave: "pipeline" makes every
    remaining rank a stage, "tensor" splits every layer over them.
    """
    if strategy not in PARALLEL_STRATEGIES:
        given = {"pp": pp, "tp": tp, "dp": dp}
        named = [f"{k}={v}" for k, v in given.items() if v not in (None, 1)]
        if named or micro_batches != 1:
            extra = named + ([f"micro_batches={micro_batches}"] if micro_batches != 1 else [])
            raise ValueError(
                f"{', '.join(extra)} need strategy='pipeline' or 'tensor', got "
                f"strategy={strategy!r}"
            )
        return None
    if strategy == "pipeline" and pp is None:
        pp = max(1, world_size // max(1, (dp or 1) * (tp or 1)))
    if strategy == "tensor" and tp is None:
        tp = max(1, world_size // max(1, (dp or 1) * (pp or 1)))
    config = ParallelConfig(
        dp=dp,
        pp=pp or 1,
        tp=tp or 1,
        micro_batches=micro_batches,
        schedule=schedule,
        chunks=chunks,
        balance=balance,
        tp_plan=tp_plan,
    )
    config.topology(world_size)  # errors now, naming every degree, rather than at setup
    return config


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def rebuild_optimizer(
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
        groups.append({**_options(group), "params": params})
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    # Empty groups stay (a stage may hold none of a group's parameters), so every rank has the
    # same groups by index: checkpoints keep per-group options that way.
    return cls(groups, **defaults)


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


def setup_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ParallelConfig,
    loss_fn: LossFn | None,
    groups: ParallelGroups,
    precision: Precision,
) -> tuple[ParallelModel, torch.optim.Optimizer | None, LossFn]:
    """Split ``model`` as ``config`` says and rebuild ``optimizer`` over this rank's share.

    Returns the split model, the rebuilt optimizer and the loss function in use.
    """
    loss_fn = loss_fn or default_loss(model, groups)
    if loss_fn is None:
        raise ValueError(
            f"strategy with pp={config.pp}, tp={config.tp} needs Job.setup(model, optimizer, "
            f"loss_fn=...) for a {type(model).__name__}: the loss is computed inside the "
            f"parallel step (on the last pipeline stage)"
        )
    names = _names(model)
    parallel = parallelize(model, groups, config, loss_fn)
    # Autocast where the forward runs: around each local pipeline chunk, or the whole model.
    parts: list[nn.Module] = (
        list(cast(Any, parallel.module).stages) if parallel.pipelined else [parallel]
    )
    for part in parts:
        precision.wrap_forward(part)
    if optimizer is None:
        return parallel, None, loss_fn
    # Names are taken from the (tensor-parallelised, in place) model; the pipeline keeps a
    # subset of those very parameter objects.
    kept = {id(p) for p in parallel.parameters()}
    local = {n: p for n, p in model.named_parameters() if id(p) in kept}
    return parallel, rebuild_optimizer(optimizer, names, local), loss_fn
