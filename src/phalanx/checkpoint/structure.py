"""Nested state (dicts, lists, tuples, numbers, strings, tensors) <-> JSON plus flat tensors.

A state dict such as an optimizer's (``{"state": {0: {"step": tensor, "exp_avg": tensor}},
"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}``) is split into

- a JSON-able *structure* in which each tensor is replaced by ``{"__tensor__": "state.0.exp_avg"}``,
- a flat ``{key: tensor}`` dict for the safetensors file.

JSON cannot tell a tuple from a list, and its object keys are strings; so tuples become
``{"__tuple__": [...]}`` and dicts whose keys are not all plain strings become
``{"__items__": [[key, value], ...]}``, which keeps integer keys (optimizer state is keyed by
parameter index) and round-trips exactly. Python floats (including inf and nan) round-trip
exactly through Python's ``json``. Anything else (a function, an arbitrary object) is an error
naming its key path, because nothing is unpickled on load.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.checkpoint.errors import CheckpointError

__all__ = ["flatten", "unflatten"]

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_RESERVED = {_TENSOR, _TUPLE, _ITEMS}
_SCALARS = (type(None), bool, int, float, str)
_PLAIN = frozenset(_SCALARS)
"""Exact types stored as they are (subclasses go through the checks)."""


class _Flattener:
    def __init__(self, what: str, allow_tensors: bool) -> None:
        self.what = what
        self.allow_tensors = allow_tensors
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor_key(self, path: str, value: torch.Tensor) -> dict[str, str]:
        if not self.allow_tensors:
            raise TypeError(
                f"{self.what} key {path!r} holds a tensor; only JSON-able values "
                f"(numbers, strings, lists, dicts) can be stored here"
            )
        key, n = path, 1
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        self.tensors[key] = value
        return {_TENSOR: key}

    def key(self, path: str, k: Any) -> Any:
        if isinstance(k, _SCALARS):
            return k
        if isinstance(k, tuple):
            return {_TUPLE: [self.key(path, x) for x in k]}
        raise TypeError(
            f"{self.what} key {path!r} has a dict key of type {type(k).__name__} "
            f"({k!r}); only str, int, float, bool, None and tuples of them are stored"
        )

    def value(self, path: str, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return self.tensor_key(path, v)
        if isinstance(v, float | int | str | bool) or v is None:
            return v
        if isinstance(v, list | tuple):
            if all(type(x) in _PLAIN for x in v):  # e.g. a generator's state: 625 ints
                items = list(v)
            else:
                items = [self.value(f"{path}.{i}", x) for i, x in enumerate(v)]
            return {_TUPLE: items} if isinstance(v, tuple) else items
        if isinstance(v, dict):
            return self.mapping(path, v)
        raise TypeError(
            f"{self.what} key {path!r} holds a {type(v).__module__}."
            f"{type(v).__qualname__} ({v!r:.80}), which is not JSON-able; store "
            f"numbers, strings, lists, dicts or tensors instead"
        )

    def mapping(self, path: str, d: dict[Any, Any]) -> Any:
        join = (lambda k: f"{path}.{k}") if path else str
        if all(isinstance(k, str) and k not in _RESERVED for k in d):
            return {k: self.value(join(k), v) for k, v in d.items()}
        return {_ITEMS: [[self.key(join(k), k), self.value(join(k), v)] for k, v in d.items()]}


def flatten(
    state: Any, what: str, *, allow_tensors: bool = True
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``state`` into a JSON-able structure and a flat dict of tensors.

    Args:
        state: Nested dicts, lists, tuples, None, bools, numbers, strings and tensors.
        what: What ``state`` is ("optimizer state", ...), for error messages.
        allow_tensors: If False a tensor anywhere is an error (for JSON-only state).

    Raises:
        TypeError: naming the key path of the first value that cannot be stored.
    """
    f = _Flattener(what, allow_tensors)
    return f.value("", state) if not isinstance(state, dict) else f.mapping("", state), f.tensors


def _restore(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [_restore(x, tensors, where) for x in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and _TENSOR in node:
        key = node[_TENSOR]
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(
                f"{where} refers to tensor {key!r:.80}, which its tensor file lacks"
            )
        return tensors[key]
    if len(node) == 1 and _TUPLE in node:
        return tuple(_restore(x, tensors, where) for x in node[_TUPLE])
    if len(node) == 1 and _ITEMS in node:
        return {_key(k): _restore(v, tensors, where) for k, v in node[_ITEMS]}
    return {k: _restore(v, tensors, where) for k, v in node.items()}


def _key(k: Any) -> Any:
    if isinstance(k, dict) and _TUPLE in k:
        return tuple(_key(x) for x in k[_TUPLE])
    return k


def unflatten(structure: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """Inverse of :func:`flatten`: put the tensors back into the structure.

    The structure comes from a checkpoint file whose nesting ``limits.parse_json`` bounded.

    Raises:
        CheckpointError: naming ``where`` (and the key) when the structure refers to a missing
            tensor or is malformed.
    """
    try:
        return _restore(structure, tensors, where)
    except (TypeError, ValueError) as exc:  # e.g. an __items__ entry that is not a pair
        raise CheckpointError(f"{where}: malformed state structure ({exc})") from None
