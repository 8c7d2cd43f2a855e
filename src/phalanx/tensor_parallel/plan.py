"""Apply a tensor-parallel plan: ``{module name: style}`` -> sharded layers, in place.

A plan names submodules by their dotted path (``model.named_modules()``); ``*`` stands for one
path component (``"blocks.*.attn.q_proj"``). Styles:

- ``"colwise"``: :class:`~phalanx.tensor_parallel.layers.ColumnParallelLinear`, output sharded.
- ``"colwise_gather"``: column-parallel with the output all-gathered (may be uneven).
- ``"vocab_head"``: column-parallel that may be uneven and keeps its output sharded: logits
  split on the vocabulary, for :func:`~phalanx.tensor_parallel.loss.vocab_parallel_cross_entropy`.
- ``"rowwise"``: :class:`~phalanx.tensor_parallel.layers.RowParallelLinear`.
- ``"embedding"``: :class:`~phalanx.tensor_parallel.layers.VocabParallelEmbedding`.
- ``"parallel_input"``: on a *parent* module: f (``copy_to_tp``) is applied once to the
  parent's input, and the column-parallel layers under it skip their own f.

Why ``"parallel_input"``: Megatron's attention runs one fused QKV matmul behind one f. A model
with separate ``q_proj``, ``k_proj``, ``v_proj`` would otherwise get three f's, hence three
all-reduces of the same input gradient in backward instead of one. Summing the three partial
gradients locally first and all-reducing once is equal by linearity. It is valid when every
parameter under the parent belongs to a parallel layer (a replicated parameter there, such as
a LayerNorm, would only see its rank's partial gradient), which :func:`parallelize_module`
checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import (
    GROUP,
    MODULE,
    check_choice,
    check_instance,
    check_str,
    checked,
    part_of,
)
from phalanx.tensor_parallel.functional import copy_to_tp
from phalanx.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = ["STYLES", "match_plan", "parallelize_module", "plan_arg"]

Group = dist.ProcessGroup | None
STYLES = ("colwise", "colwise_gather", "vocab_head", "rowwise", "embedding", "parallel_input")
_LINEAR = ("colwise", "colwise_gather", "vocab_head", "rowwise")


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def plan_arg(name: str, value: Any, where: str) -> Mapping[str, str]:
    """Argument rule of a plan: a mapping of module name (or pattern) -> one of :data:`STYLES`."""
    what = "a dict of module name -> style, e.g. {'fc1': 'colwise', 'fc2': 'rowwise'}"
    check_instance(name, value, Mapping, what, where=where)
    with part_of(name, value, where):
        for pattern, style in value.items():
            check_str("a module name", pattern)
            check_choice(f"{name}[{pattern!r}]", style, STYLES)
    return value


def match_plan(names: Iterable[str], plan: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Resolve a plan against module names: ``{name: (plan entry, style)}``, in ``names`` order.

    Pure: needs only the names. Raises ``ValueError`` naming the entry for an unknown style,
    an entry that matches no module, or a module that two entries claim.
    """
    plan_arg("plan", plan, "match_plan")
    resolved: dict[str, tuple[str, str]] = {}
    used: set[str] = set()
    for name in names:
        for pattern, style in plan.items():
            if not _matches(pattern, name):
                continue
            if name in resolved:
                raise ValueError(
                    f"tensor-parallel plan entries {resolved[name][0]!r} and {pattern!r} "
                    f"both match module {name!r}"
                )
            resolved[name] = (pattern, style)
            used.add(pattern)
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"tensor-parallel plan entries {unused} match no submodule")
    return resolved


def _build(style: str, module: nn.Module, group: Group, sync: bool) -> nn.Module:
    if style == "rowwise":
        return RowParallelLinear.from_dense(module, group)
    if style == "embedding":
        return VocabParallelEmbedding.from_dense(module, group)
    return ColumnParallelLinear.from_dense(
        module,
        group,
        sync_input_grad=sync,
        gather_output=style == "colwise_gather",
        allow_uneven=style in ("colwise_gather", "vocab_head"),
    )


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def _check_parent(model: nn.Module, name: str, resolved: dict[str, tuple[str, str]]) -> None:
    """A ``parallel_input`` parent may hold only parallel layers' parameters, and a column one."""
    pattern = resolved[name][0]
    linear = {n for n, (_, style) in resolved.items() if style in _LINEAR}
    stray = [
        p
        for p, _ in model.get_submodule(name).named_parameters()
        if f"{name}.{p}".rpartition(".")[0] not in linear
    ]
    if stray:
        raise ValueError(
            f"tensor-parallel plan entry {pattern!r} ({name}): 'parallel_input' needs every "
            f"parameter under it in a parallel layer, but {stray} would stay replicated (their "
            f"gradients would be partial); shard them or move them out"
        )
    if not any(n.startswith(name + ".") and resolved[n][1] != "rowwise" for n in linear):
        raise ValueError(
            f"tensor-parallel plan entry {pattern!r} ({name}): 'parallel_input' needs a "
            f"column-parallel layer under it; without one its input gradient is summed tp times"
        )


def _apply_f_once(parent: nn.Module, group: Group) -> None:
    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def wrap(a: Any) -> Any:
            return copy_to_tp(a, group) if isinstance(a, torch.Tensor) else a

        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

    parent.register_forward_pre_hook(hook, with_kwargs=True)


@checked(model=MODULE, plan=plan_arg, group=GROUP)
def parallelize_module(model: nn.Module, plan: Mapping[str, str], group: Group) -> nn.Module:
    """Replace, in place, each submodule the plan names with its tensor-parallel version.

    Each layer is built by ``from_dense`` from the module it replaces, so the parallel model
    computes what the dense one did. Apply the same plan to identically initialised models on
    every rank of ``group``.

    Args:
        model: The dense model; modified in place.
        plan: ``{dotted name or pattern with '*': style}``; styles in :data:`STYLES`.
        group: The tensor-parallel process group (``None``: the default group).

    Returns:
        ``model``.

    Raises:
        ValueError: an unknown style, an entry matching nothing, a shape that does not split,
            or a ``parallel_input`` parent with replicated parameters; the entry is named.
        TypeError: a module of the wrong type for its style (entry named).
    """
    resolved = match_plan((n for n, _ in model.named_modules() if n), plan)
    parents = [n for n, (_, style) in resolved.items() if style == "parallel_input"]
    for name in parents:
        _check_parent(model, name, resolved)
        outer = [p for p in parents if name.startswith(p + ".")]
        if outer:  # two f's on one path would sum the gradient tp times
            raise ValueError(
                f"tensor-parallel plan: 'parallel_input' on {name!r} is nested "
                f"inside 'parallel_input' on {outer[0]!r}; keep one"
            )
    layers: dict[
        str, nn.Module
    ] = {}  # build everything first: a failing entry leaves the model untouched
    for name, (pattern, style) in resolved.items():
        if style == "parallel_input":
            continue
        sync = not any(name.startswith(p + ".") for p in parents)
        try:
            layers[name] = _build(style, model.get_submodule(name), group, sync)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"tensor-parallel plan entry {pattern!r} ({name}): {exc}") from exc
    for name, layer in layers.items():
        _replace(model, name, layer)
    for name in parents:
        _apply_f_once(model.get_submodule(name), group)
    return model
