"""Pure planning for ZeRO-3: which submodules become units, which parameters each unit owns,
and how large each rank's shard is (the pieces of the original tensors a shard holds come
from :func:`~phalanx.sharding.pieces.pieces_in_range`).

No process group here: everything is a function of the module tree, the world size and the
rank, so it is unit-tested in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = [
    "ParamRef",
    "WrapPolicy",
    "assign_params",
    "normalize_wrap",
    "padded_size",
    "select_units",
]

WrapPolicy = Callable[[nn.Module], bool] | type | tuple[type, ...] | None


@dataclass
class ParamRef:
    """One distinct parameter object and every place it is registered in the module tree."""

    param: nn.Parameter
    keys: list[str] = field(default_factory=list)
    """Fully qualified names (state-dict keys); the first is canonical."""
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    """Distinct ``(module, attribute)`` pairs that hold it (more than one when tied)."""


def normalize_wrap(wrap: WrapPolicy) -> Callable[[nn.Module], bool] | None:
    """Turn ``wrap`` (class, tuple of classes, predicate or None) into a predicate.

    Raises:
        TypeError: ``wrap`` is none of those, or names a class that is not an ``nn.Module``.
    """
    if wrap is None:
        return None
    if isinstance(wrap, type) or (isinstance(wrap, tuple) and wrap):
        classes = wrap if isinstance(wrap, tuple) else (wrap,)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"wrap={wrap!r}: expected nn.Module subclasses, got {cls!r} among them"
                )
        return lambda m: isinstance(m, classes)
    if callable(wrap):
        return wrap
    raise TypeError(
        f"wrap={wrap!r} ({type(wrap).__name__}): expected an nn.Module class, a non-empty "
        f"tuple of classes, a callable module -> bool, or None"
    )


def select_units(
    module: nn.Module, wrap: Callable[[nn.Module], bool] | None
) -> list[tuple[str, nn.Module]]:
    """Outermost submodules (not the root) that ``wrap`` selects, in registration order.

    A selected module's descendants are not considered (no nested units): their parameters
    belong to the enclosing unit.
    """
    if wrap is None:
        return []
    chosen: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for name, sub in module.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        if id(sub) not in seen and wrap(sub):
            chosen.append((name, sub))
            seen.add(id(sub))
    return chosen


def _owner(fqn: str, prefixes: Sequence[str]) -> int:
    """Index of the unit whose prefix contains ``fqn``, or -1 (the root)."""
    for i, prefix in enumerate(prefixes):
        if fqn.startswith(prefix + "."):
            return i
    return -1


def assign_params(
    module: nn.Module, prefixes: Sequence[str]
) -> tuple[list[list[ParamRef]], list[ParamRef]]:
    """Distribute every distinct parameter of ``module`` to a unit (by prefix) or the root.

    A parameter registered under more than one unit, or under a unit and outside all units
    (tied weights), belongs to the root, which stays gathered for the whole step, so every
    user sees one tensor. Order within a unit is registration order.

    Returns:
        ``(per_unit, root)``: lists of :class:`ParamRef`.
    """
    refs: dict[int, ParamRef] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            ref = refs.setdefault(id(p), ParamRef(p))
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if fqn not in ref.keys:
                ref.keys.append(fqn)
            if not any(m is mod and n == pname for m, n in ref.slots):
                ref.slots.append((mod, pname))
    per_unit: list[list[ParamRef]] = [[] for _ in prefixes]
    root: list[ParamRef] = []
    for ref in refs.values():
        owners = {_owner(k, prefixes) for k in ref.keys}
        if len(owners) == 1 and -1 not in owners:
            per_unit[owners.pop()].append(ref)
        else:
            root.append(ref)
    return per_unit, root


def padded_size(total: int, world: int) -> int:
    """``total`` rounded up to a multiple of ``world`` (every rank's shard the same size)."""
    return -(-total // world) * world
