"""A phalanx checkpoint as one plain state dict, and back: what the DCP and HF converters share.

:func:`read_state` gives ``{"model": ..., "optimizer": ..., "scheduler": ..., <object>: ...}``
(the sections the checkpoint holds, its ``objects`` flattened to top-level names) with full
tensors, whatever world size saved it: sharded pieces are assembled as ``load`` assembles them
for a plain model and optimizer. :func:`write_state` commits such a dict as a checkpoint of one
rank, through :func:`phalanx.checkpoint.save` (atomic, verified), from which ``load`` reshards to
any world size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch import nn

from phalanx._check import check_path, fail
from phalanx.checkpoint import catalog, structure
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.manifest import Manifest, read_manifest
from phalanx.checkpoint.saving import OBJECTS, save
from phalanx.checkpoint.sections import read_section
from phalanx.checkpoint.sharded import is_sharded_in, read_sharded
from phalanx.sharding.optimizer_pieces import full_optimizer_state

__all__ = [
    "SECTIONS",
    "checkpoint_dir",
    "read_state",
    "single_process",
    "source_dir",
    "target_dir",
    "write_state",
]

SECTIONS = ("model", "optimizer", "scheduler")
"""The sections that keep their names; any other top-level key is one of the ``objects``."""


def single_process(where: str) -> None:
    """Refuse to run inside a job of several ranks: ``save`` would be collective over them."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"{where}() converts in one process, but torch.distributed runs "
            f"{dist.get_world_size()} ranks here; call it from one process (e.g. rank 0 "
            f"after a barrier, in a separate script)"
        )


def source_dir(src: str | os.PathLike[str], where: str) -> Path:
    """``src`` as a Path, refusing one that is not a directory (naming it and ``where``)."""
    check_path("src", src, where=where)
    if not Path(src).is_dir():
        raise fail("src", os.fspath(src), "an existing directory", where=where)
    return Path(src)


def target_dir(dst: str | os.PathLike[str], where: str) -> Path:
    """``dst`` as a Path, refusing one that exists and is not a directory (naming it)."""
    check_path("dst", dst, where=where)
    if os.path.lexists(dst) and not Path(dst).is_dir():
        raise fail(
            "dst",
            os.fspath(dst),
            "a directory to write into",
            where=where,
            fix="it is an existing file; give a new or existing directory",
        )
    return Path(dst)


def checkpoint_dir(src: str | os.PathLike[str], where: str) -> Path:
    """The checkpoint ``src`` names: a ``step-NNNNNN`` directory, or the newest in a root."""
    path = source_dir(src, where)
    if (path / "manifest.json").exists():
        return path
    found = catalog.latest(path)
    if found is None:
        raise CheckpointError(
            f"{where}(src={os.fspath(src)!r}): neither a checkpoint (no manifest.json) nor a "
            f"directory holding a committed one"
        )
    return found


def _full(ckpt: Path, manifest: Manifest, what: str) -> Any:
    meta, reader = read_sharded(ckpt, manifest, what)
    if what == "optimizer":
        return full_optimizer_state(meta, reader)
    return {k: reader.full(k) for k in reader.keys()}  # noqa: SIM118


def read_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full state of the checkpoint ``ckpt`` (every section but the ranks' own) and the
    ``extra`` dict given to the ``save`` that wrote it."""
    manifest = read_manifest(ckpt)
    state: dict[str, Any] = {}
    for what in ("model", "optimizer"):
        if is_sharded_in(manifest, what):
            try:
                state[what] = _full(ckpt, manifest, what)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                bad = f"{ckpt}: the saved {what} pieces are invalid: {exc}"
                raise CheckpointError(bad) from exc
    for what in (*SECTIONS, OBJECTS):
        if what in manifest.sections and what not in state:
            state[what] = read_section(ckpt, manifest, what)
    objects = state.pop(OBJECTS, {})
    if not isinstance(objects, dict):
        raise CheckpointError(f"{ckpt / OBJECTS}.json: the objects state is not a dict")
    state.update(objects)
    extra = structure.unflatten(manifest.extra, {}, str(ckpt / "manifest.json"))
    return state, extra if isinstance(extra, dict) else {}


class _Held:
    """A state dict posing as the object ``save`` asks ``state_dict()`` of."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state


def write_state(
    dst: str | os.PathLike[str], step: int, state: dict[str, Any], extra: dict[str, Any]
) -> Path:
    """Commit ``state`` (as :func:`read_state` gives it) as step ``step`` of ``dst``."""
    for name in state:
        if not isinstance(name, str) or not name:
            raise fail("state key", name, "a non-empty string", error=TypeError)
    held = {k: _Held(v) for k, v in state.items()}
    # save() asks the model only for state_dict() (and unwraps DDP-style .module attributes,
    # which _Held has none of), so the held dict stands in for the module.
    model = cast(nn.Module | None, held.pop("model", None))
    return save(
        dst,
        step,
        model=model,
        optimizer=cast(Any, held.pop("optimizer", None)),
        scheduler=held.pop("scheduler", None),
        objects=cast(dict[str, Any], held) or None,
        extra=extra,
        keep_last=None,
    )
