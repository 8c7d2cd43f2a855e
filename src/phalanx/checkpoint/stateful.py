"""``save(objects=...)`` / ``load(objects=...)``: named stateful objects and plain values.

As in torch DCP's state dict, each value of ``objects`` is either

- **stateful**: anything with ``state_dict()`` (to save) / ``load_state_dict()`` (to load), torch's
  ``Stateful`` protocol: a module, an optimizer, a metric, a data-loader state, your own class;
- **a value**: a tensor, or a JSON-able number, string, bool, None, list, tuple or dict (of
  those and tensors). ``load`` copies a saved tensor into a given tensor in place (same shape
  and dtype) and puts any other value into the ``objects`` dict under its name, replacing the
  one given, as DCP's ``load`` modifies its state dict in place.

Anything else is a ``TypeError`` naming the object, before any rank writes or reads.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx._check import fail
from phalanx.checkpoint import structure
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.sections import load_into

__all__ = ["check_objects", "object_state", "restore_object"]

_VALUES = (torch.Tensor, int, float, str, bool, type(None), list, tuple, dict)
_WHAT = "an object with {method}() (torch's Stateful protocol), a tensor or a JSON-able value"


def check_objects(where: str, objects: object) -> dict[str, Any]:
    """``objects`` (None or a dict of names to stateful objects or values) as a dict.

    Raises:
        TypeError: naming ``objects`` or the entry that is neither stateful nor storable.
    """
    if objects is None:
        return {}
    if not isinstance(objects, dict):
        raise fail("objects", objects, "a dict of names to objects", where=where, error=TypeError)
    method = "state_dict" if where == "save" else "load_state_dict"
    for name, obj in objects.items():
        if not isinstance(name, str) or not name:
            raise fail("objects key", name, "a non-empty str", where=where, error=TypeError)
        if callable(getattr(obj, method, None)):
            continue
        what = _WHAT.format(method=method)
        if not isinstance(obj, _VALUES):
            raise fail(f"objects[{name!r}]", obj, what, where=where, error=TypeError)
        if where == "save":
            try:
                structure.flatten(obj, f"save(objects[{name!r}])")
            except TypeError as exc:
                raise TypeError(f"{exc}; objects[{name!r}] must be {what}") from None
    return objects


def object_state(obj: Any) -> Any:
    """What ``save`` stores for ``obj``: its ``state_dict()``, or the value itself."""
    method = getattr(obj, "state_dict", None)
    return method() if callable(method) else obj


def restore_object(objects: dict[str, Any], name: str, state: Any, where: str) -> None:
    """Restore ``objects[name]`` from its saved ``state`` (``where`` names the file)."""
    obj = objects[name]
    if callable(getattr(obj, "load_state_dict", None)):
        load_into(obj, state, f"object {name!r}", where)
    elif isinstance(obj, torch.Tensor):
        if not isinstance(state, torch.Tensor) or (state.shape, state.dtype) != (
            obj.shape,
            obj.dtype,
        ):
            found = (
                f"{tuple(state.shape)} {state.dtype}"
                if isinstance(state, torch.Tensor)
                else type(state).__name__
            )
            raise CheckpointError(
                f"{where}: object {name!r} was saved as {found}; the tensor given to load is "
                f"{tuple(obj.shape)} {obj.dtype}"
            )
        with torch.no_grad():
            obj.copy_(state)
    else:
        objects[name] = state
