"""Checks of ``save`` / ``load``'s arguments, before any rank writes, reads or communicates."""

from __future__ import annotations

from typing import Any

from phalanx._check import check_group, check_path, fail
from phalanx.sharding.pieces import Sharded

__all__ = ["check_targets"]


def check_targets(where: str, directory: object, group: object, **objects: Any) -> None:
    """``directory`` a path, ``group`` a process group, and the ``objects`` (model, optimizer,
    scheduler, sampler) None, :class:`Sharded` views, or things with the state-dict method that
    ``where`` calls: ``state_dict`` to save, ``load_state_dict`` to load."""
    check_path("directory", directory, where=where)
    check_group("group", group, where=where)
    method = "state_dict" if where == "save" else "load_state_dict"
    for name, value in objects.items():
        if value is None or isinstance(value, Sharded):
            continue
        if not callable(getattr(value, method, None)):
            what = f"{'an nn.Module or ' if name == 'model' else ''}an object with {method}()"
            raise fail(name, value, what, where=where, error=TypeError)
