"""Converting between phalanx checkpoints and torch DCP (``torch.distributed.checkpoint``).

::

    from phalanx import checkpoint

    checkpoint.to_dcp("ckpt", "dcp_ckpt", param_names=[n for n, _ in model.named_parameters()])
    checkpoint.from_dcp("dcp_ckpt", "ckpt2")  # then checkpoint.load("ckpt2", model=..., ...)

The DCP checkpoint holds the top-level keys ``model`` (the module's state dict), ``optimizer``,
``scheduler`` and one per tracked object, as ``dcp.save({"model": ..., "optimizer": ...})``
writes them. With ``param_names`` the optimizer state is keyed by parameter name, the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict`` (torchtitan, FSDP2); without, by
index, as ``optimizer.state_dict()`` (DCP turns the index keys into strings). ``from_dcp`` reads
either layout into torch's index form and keeps the names in the checkpoint's ``extra``
(``"dcp_param_names"``), so that ``to_dcp`` writes them back: both round trips are bit-exact,
whatever world size saved the source (phalanx pieces and DCP chunks are assembled whole; the
phalanx checkpoint ``from_dcp`` writes loads at any world size).

Reading DCP never unpickles anything but DCP's own metadata classes (see
:mod:`phalanx.checkpoint.dcp_metadata`); its non-tensor values load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from phalanx._check import check_int, check_path, fail, shown
from phalanx.checkpoint.dcp_metadata import METADATA, read_metadata
from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.interop_state import (
    checkpoint_dir,
    read_state,
    single_process,
    source_dir,
    target_dir,
    write_state,
)

__all__ = ["NAMES_KEY", "from_dcp", "read_dcp", "to_dcp"]

NAMES_KEY = "dcp_param_names"
"""``extra`` key where :func:`from_dcp` keeps the optimizer's parameter names."""


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata :func:`read_metadata` read and checked before."""

    def __init__(self, directory: Path, meta: md.Metadata) -> None:
        super().__init__(directory)
        self.checked = meta

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        self.checked.storage_meta = md.StorageMeta(load_id=self.load_id)
        return self.checked


class _SafePlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the state dict from the metadata; non-tensor values load ``weights_only``."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"{self.directory}: value {shown(fqn)} cannot be read ({_first_line(exc)})"
            ) from None
        # DefaultLoadPlanner.load_bytes, but with the value loaded above (it unpickles fully).
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _first_line(exc: object) -> str:
    """``Type: message`` of ``exc``, its first line cut to 200 characters (torch's messages
    can hold whole tracebacks and C++ frames)."""
    lines = str(exc).strip().splitlines() or [""]
    text = lines[0] if len(lines[0]) <= 200 else lines[0][:197] + "..."
    return f"{type(exc).__name__}: {text}"


def _unwrapped(exc: CheckpointException, directory: Path) -> CheckpointError:
    """Our own error inside DCP's wrapper (a rank -> (exception, traceback) dict), or a short
    one naming ``directory`` and the first failure (not DCP's text, which holds every trace)."""
    inner: object = exc
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return CheckpointError(f"{directory}: cannot read the DCP checkpoint ({_first_line(inner)})")


def read_dcp(src: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole state of the DCP checkpoint in ``src`` (every rank's chunks assembled).

    Raises:
        CheckpointError: naming the file for a missing, crafted or inconsistent checkpoint.
    """
    check_path("src", src, where="read_dcp")
    directory = Path(src)
    reader = _SafeReader(directory, read_metadata(directory))  # refusals here name .metadata
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, reader, planner=_SafePlanner(directory), no_dist=True)
    except CheckpointException as exc:
        raise _unwrapped(exc, directory) from None
    except CheckpointError:
        raise
    except Exception as exc:  # raised outside DCP's wrapper, e.g. by a crafted value's shape
        raise CheckpointError(
            f"{directory}: cannot read the DCP checkpoint ({_first_line(exc)})"
        ) from None
    return state


def _groups(opt: Any, where: str) -> list[dict[str, Any]]:
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(f"{where}: the optimizer state has no list of param_groups")
    if not isinstance(opt.get("state", {}), dict):
        raise CheckpointError(f"{where}: the optimizer's 'state' is not a dict")
    return groups


def _by_name(opt: dict[str, Any], names: Sequence[str], where: str) -> dict[str, Any]:
    """torch's index-keyed optimizer state keyed by ``names`` (parameter i is ``names[i]``)."""
    groups = _groups(opt, where)
    count = sum(len(g["params"]) for g in groups)
    if len(names) != count or len(set(names)) != count:
        raise ValueError(
            f"to_dcp(param_names=...): {len(names)} names ({len(set(names))} distinct) for an "
            f"optimizer over {count} parameters; give each parameter's name, in order"
        )
    state = {names[i]: v for i, v in opt.get("state", {}).items()}
    return {
        "state": state,
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }


def _by_index(opt: Any, where: str) -> tuple[dict[str, Any], list[str] | None]:
    """DCP's optimizer state (keyed by name, or by index as strings) in torch's index form,
    and the names when it had them."""
    groups = _groups(opt, where)
    params = [p for g in groups for p in g["params"]]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in params):
        ids = {str(p): p for p in params}
        names = None
    elif all(isinstance(p, str) for p in params) and len(set(params)) == len(params):
        ids = {name: i for i, name in enumerate(params)}
        names = list(params)
    else:
        raise CheckpointError(f"{where}: the optimizer's params are neither all names nor indices")
    unknown = [k for k in opt.get("state", {}) if k not in ids]
    if unknown:
        raise CheckpointError(f"{where}: optimizer state for unknown parameters {unknown[:5]}")
    state = {ids[k]: v for k, v in opt.get("state", {}).items()}
    groups = [{**g, "params": [ids[str(p)] for p in g["params"]]} for g in groups]
    return {"state": state, "param_groups": groups}, names


def to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    param_names: Sequence[str] | None = None,
) -> Path:
    """Write the phalanx checkpoint ``src`` as a torch DCP checkpoint in ``dst``; one process.

    Args:
        src: A checkpoint (``step-NNNNNN`` directory) or a directory given to ``save`` (its
            newest committed checkpoint), saved at any world size.
        dst: The DCP checkpoint directory to write (``.metadata`` and ``__0_0.distcp``).
        param_names: The optimizer's parameter names in order (``[n for n, _ in
            model.named_parameters()]``): the optimizer state is then keyed by name, as
            ``get_state_dict`` gives it. Default: the names ``from_dcp`` recorded, or indices.

    Returns:
        ``dst`` as a Path.
    """
    single_process("to_dcp")
    target_dir(dst, "to_dcp")
    ckpt = checkpoint_dir(src, "to_dcp")
    state, extra = read_state(ckpt)
    names = param_names if param_names is not None else extra.get(NAMES_KEY)
    if names is not None and "optimizer" in state:
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise fail("param_names", names, "a sequence of str", where="to_dcp", error=TypeError)
        state["optimizer"] = _by_name(state["optimizer"], list(names), str(ckpt))
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: it does
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_save(state, storage_writer=FileSystemWriter(dst), no_dist=True)
    return Path(dst)


def from_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, step: int = 0) -> Path:
    """Write the torch DCP checkpoint ``src`` as a phalanx checkpoint of ``step`` in ``dst``.

    ``load`` then restores it at any world size: ``model`` into the module, ``optimizer``,
    ``scheduler``, and every other top-level key into ``load(objects={key: ...})``. Its rank
    file holds the converting process's random generators: load with ``rng=False``.

    Raises:
        CheckpointError: naming the file, for a crafted or inconsistent ``src`` (its
            ``.metadata`` is read without running any code it carries).
    """
    single_process("from_dcp")
    target_dir(dst, "from_dcp")
    step = check_int("step", step, min=0, where="from_dcp")
    state = read_dcp(source_dir(src, "from_dcp"))
    extra: dict[str, Any] = {}
    if "optimizer" in state:
        state["optimizer"], names = _by_index(state["optimizer"], str(Path(src) / METADATA))
        if names is not None:
            extra[NAMES_KEY] = names
    return write_state(dst, step, state, extra)
