"""Checks of ``save`` / ``load``'s arguments, before any rank writes, reads or communicates."""

from __future__ import annotations

from typing import Any

from phalanx._check import check_group, check_module, check_path, fail

__all__ = ["check_targets"]


def check_targets(where: str, directory: object, group: object, **objects: Any) -> None:
    """``directory`` a path, ``group`` a process group; ``model`` a module, and the other
    ``objects`` (optimizer, scheduler, sampler) things with the state-dict method that ``where``
    calls (``state_dict`` to save, ``load_state_dict`` to load), or None."""
    check_path("directory", directory, where=where)
    check_group("group", group, where=where)
    method = "state_dict" if where == "save" else "load_state_dict"
    for name, value in objects.items():
        if value is None:
            continue
        if name == "model":
            check_module(name, value, where=where)
        elif not callable(getattr(value, method, None)):
            raise fail(name, value, f"an object with {method}()", where=where, error=TypeError)
