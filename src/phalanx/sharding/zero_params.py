"""Checks on what a ZeRO-1/2 optimizer is given, with torch's exception types.

``torch.distributed.optim.ZeroRedundancyOptimizer`` raises ``TypeError`` for ``params`` of the
wrong type (a single tensor, a number, an iterable holding something other than tensors or
parameter groups) and ``ValueError`` for an empty list, a group without ``"params"``, sparse
tensors or mixed dtypes; so does phalanx's, naming the argument, the position and the value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from phalanx._check import FLAG, GROUP, check_float, checked, fail, rule

__all__ = [
    "NOT_ELEMENTWISE",
    "check_elementwise",
    "check_flags",
    "check_options",
    "check_params",
    "check_replicate",
    "check_same_dense_type",
    "check_zero_args",
    "sync_options",
]

NOT_ELEMENTWISE = {
    "LBFGS": "it needs the whole parameter vector and a closure",
    "Adafactor": "it factors each matrix's second moment by rows and columns",
    "Muon": "it orthogonalises each weight matrix",
    "SparseAdam": "it steps sparse gradients",
}
WHERE = "ZeroRedundancyOptimizer"


def check_elementwise(cls: type) -> None:
    """Refuse optimizers that need whole tensors: a shard holds slices of parameters."""
    why = NOT_ELEMENTWISE.get(cls.__name__)
    if why is not None and cls.__module__.startswith("torch.optim"):
        raise ValueError(
            f"optimizer_class={cls.__name__} cannot step a ZeRO shard: {why}, while a shard may "
            f"hold a slice of a parameter; use an element-wise optimizer (SGD, Adam, AdamW, "
            f"Adagrad, RMSprop, ...) or strategy='ddp'"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return torch.typename(value)
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _check_tensors(values: Iterable[Any], where: str) -> None:
    for i, p in enumerate(values):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}[{i}] must be a Tensor, got {_describe(p)}")


def check_params(params: Any) -> list[Any]:
    """``params`` as a list of tensors or of parameter groups, or torch's exception type.

    Raises:
        TypeError: ``params`` is a tensor, not iterable, or holds other than tensors or dicts.
        ValueError: ``params`` is empty, or a group has no ``"params"`` key.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"params must be an iterable of Tensors or dicts (parameter groups), got a single "
            f"{torch.typename(params)}; pass [tensor] or model.parameters()"
        )
    try:
        items = list(params)
    except TypeError:
        what = "an iterable of Tensors or dicts (parameter groups)"
        raise fail("params", params, what, where=WHERE, error=TypeError) from None
    if not items:
        raise ValueError("params is empty: ZeroRedundancyOptimizer needs at least one parameter")
    if not all(isinstance(g, dict) for g in items):
        _check_tensors(items, "params")
        return items
    groups = []
    for gi, group in enumerate(items):
        if "params" not in group:
            raise ValueError(
                f"params[{gi}] is a parameter group without a 'params' key (keys: {sorted(group)})"
            )
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # a generator is read once
        _check_tensors(ps, f"params[{gi}]['params']")
        groups.append({**group, "params": ps})
    return groups


def check_same_dense_type(params: list[torch.Tensor], where: str = "params") -> None:
    """One dense dtype on one device for every parameter (one flat buffer per bucket).

    Raises:
        ValueError: a sparse tensor, or two dtypes or devices, naming the first offender.
    """
    for i, p in enumerate(params):
        if p.layout != torch.strided:
            raise ValueError(
                f"{where}[{i}] is a {p.layout} tensor; ZeroRedundancyOptimizer shards dense "
                f"parameters only"
            )
        first = params[0]
        if (p.dtype, p.device) != (first.dtype, first.device):
            raise ValueError(
                f"every parameter must share one dtype and device: {where}[0] is "
                f"{first.dtype} on {first.device}, {where}[{i}] is {p.dtype} on {p.device}"
            )


NUMERIC_OPTIONS = ("lr", "momentum", "dampening", "weight_decay", "eps", "alpha", "lr_decay")
"""Options that torch's optimizers take as numbers: a string there (``lr="0.1"``) is named by the
wrapper rather than failing inside ``torch.optim`` with a bare comparison error. Anything else
(a tuple such as Adafactor's ``eps=(None, 1e-3)``, a tensor, a negative value) is the
optimizer's to judge, as under torch's ZeroRedundancyOptimizer."""


def check_options(optimizer_class: Any, stage: int | None, defaults: dict[str, Any]) -> None:
    """The constructor's other arguments (``params`` aside; flags by the argument rules)."""
    if stage not in (None, 1, 2) or isinstance(stage, bool):
        what = "None (gradients averaged by DDP), 1 or 2 (stage 3 is FullyShardedDataParallel)"
        raise fail("stage", stage, what, where=WHERE)
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        what = "a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW"
        raise fail("optimizer_class", optimizer_class, what, where=WHERE, error=TypeError)
    check_elementwise(optimizer_class)
    for key in NUMERIC_OPTIONS:
        if isinstance(defaults.get(key), str):
            check_float(key, defaults[key], where=WHERE)


def check_replicate(stage: int | None, replicate_group: Any) -> None:
    """Hybrid sharding averages the gradients itself: it needs ``stage`` 1 or 2."""
    if replicate_group is not None and stage is None:
        raise ValueError(
            f"{WHERE}(replicate_group=...): hybrid sharding averages the gradients itself, "
            f"so it needs stage=1 or stage=2 (stage=None leaves them to DDP over every rank)"
        )


def check_flags(overlap_with_ddp: bool) -> None:
    """``overlap_with_ddp`` (a bool, by the argument rules) is refused when True."""
    if overlap_with_ddp:
        raise ValueError(
            "overlap_with_ddp=True is not supported: torch runs that step inside DDP "
            "communication hooks (ddp_zero_hook) that drive its own class's private state. To "
            "overlap gradient communication with backward, drop DDP and pass stage=2"
        )


check_zero_args = checked(
    process_group=GROUP,
    replicate_group=GROUP,
    parameters_as_bucket_view=FLAG,
    overlap_with_ddp=FLAG,
    broadcast_params=FLAG,
    bucket_cap_mb=rule(check_float, above=0, fix="a size in MiB, e.g. 25"),
)
"""Decorates ``ZeroRedundancyOptimizer.__init__``: the types and ranges of its arguments."""


def sync_options(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    """Copy every group option but ``params`` (an lr set by a scheduler, a key the inner
    optimizer adds) from ``src`` to ``dst``, group by group."""
    for s, d in zip(src, dst):
        d.update({k: v for k, v in s.items() if k != "params"})
