"""``load``: every rank reads the checkpoint rank 0 chose, verifying each file it reads.

Rank 0 picks the checkpoint (``latest`` or ``path=``) and tells the others through the
rendezvous store (``sync.py``), so all ranks load the same one. Each rank reads the replicated
sections it was given objects for, plus its own ``rank-NNNNN`` section (RNG, sampler), checking
sizes and checksums against the manifest while reading. Ranks then report success through the
store, so a failure on any rank raises on every rank instead of leaving the others to hang.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from phalanx._check import check_bool, check_path
from phalanx.checkpoint import background, catalog, structure
from phalanx.checkpoint.args import check_targets
from phalanx.checkpoint.manifest import (
    CheckpointError,
    Manifest,
    read_manifest,
    verify_files,
)
from phalanx.checkpoint.rng import restore as restore_rng
from phalanx.checkpoint.saving import OBJECTS, rank_section_name
from phalanx.checkpoint.sections import load_into, load_model, read_section, unwrap
from phalanx.checkpoint.sharded import (
    as_sharded,
    is_sharded_in,
    read_sharded,
    shard_section_name,
)
from phalanx.checkpoint.stateful import check_objects, restore_object
from phalanx.checkpoint.sync import Session, open_session
from phalanx.sharding.optimizer_pieces import full_optimizer_state

__all__ = ["CheckpointInfo", "load"]

T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` loaded."""

    path: Path
    """The checkpoint directory."""
    step: int
    """The step given to ``save``."""
    extra: dict[str, Any]
    """The ``extra`` dict given to ``save``."""
    world_size: int
    """Number of ranks that saved it."""
    notes: tuple[str, ...] = ()
    """What could not be restored exactly (e.g. RNG of ranks that do not exist now)."""
    sampler: dict[str, Any] | None = None
    """This rank's saved sampler state (None: ``save`` got no sampler), loaded or not: a
    sampler made after the load can take it."""


def _resolve(directory: str | os.PathLike[str], path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        found = catalog.latest(directory)
        return None if found is None else str(found.absolute())
    chosen = Path(path)
    if not chosen.is_dir() and (Path(directory) / chosen).is_dir():
        chosen = Path(directory) / chosen  # a name such as "step-000123"
    elif not chosen.is_dir() and (aside := catalog.stranded_copy(Path(directory), str(path))):
        chosen = aside  # its re-save was killed between the renames: the old copy stands
    read_manifest(chosen)  # raises naming the file when it is not a complete checkpoint
    return str(chosen.absolute())


def _section(ckpt: Path, manifest: Manifest, name: str, strict: bool) -> Any | None:
    if name in manifest.sections:
        return read_section(ckpt, manifest, name)
    message = f"{ckpt} holds no {name} state (it holds: {', '.join(manifest.sections) or 'none'})"
    if strict:
        raise CheckpointError(f"{message}; pass strict=False to load the rest")
    warnings.warn(f"{message}; {name} not restored (strict=False)", stacklevel=4)
    return None


_RANK_FILE = re.compile(r"rank-(\d+)(?:-\d+)?\.(?:json|safetensors)")


def _verify_absent_ranks(ckpt: Path, manifest: Manifest, size: int) -> None:
    """Verify the files of saved ranks >= ``size`` (one pass over the manifest's entries)."""
    own = {
        k: v
        for k, v in manifest.files.items()
        if (m := _RANK_FILE.fullmatch(k)) is not None and int(m.group(1)) >= size
    }
    verify_files(ckpt, Manifest(manifest.step, manifest.world_size, own, []))


def _checked(state: Any, where: Path) -> dict[str, Any]:
    """A rank file's state: a dict with ``rng`` (a dict) and ``sampler``."""
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        found = type(state.get("rng") if isinstance(state, dict) else state).__name__
        raise CheckpointError(
            f"{where}: a rank's state is an object with the generators under 'rng' (an "
            f"object) and 'sampler'; found {found}. The file is corrupt or crafted"
        )
    if "sampler" not in state:
        raise CheckpointError(f"{where}: the rank's state has no 'sampler' entry")
    return state


def _rank_state(
    ckpt: Path, manifest: Manifest, session: Session, notes: list[str]
) -> dict[str, Any]:
    name = rank_section_name(session.rank)
    if f"{name}.json" not in manifest.files:
        notes.append(
            f"rank {session.rank} did not exist when the checkpoint was saved (world "
            f"size {manifest.world_size}): its RNG is not restored and its sampler "
            f"state is rank 0's"
        )
        name = rank_section_name(0)
    state = _checked(read_section(ckpt, manifest, name), ckpt / f"{name}.json")
    if session.rank == 0 and manifest.world_size > session.size:
        notes.append(
            f"saved by {manifest.world_size} ranks, loaded by {session.size}: the RNG "
            f"states of ranks {session.size}..{manifest.world_size - 1} are ignored"
        )
        _verify_absent_ranks(ckpt, manifest, session.size)
    return state if name == rank_section_name(session.rank) else {"sampler": state["sampler"]}


@dataclass(frozen=True)
class _Targets:
    """The objects ``load`` restores into."""

    model: nn.Module | None
    optimizer: Any
    scheduler: Any
    sampler: Any
    objects: dict[str, Any]
    rng: bool
    strict: bool


def _from_pieces(ckpt: Path, what: str, read: Callable[[], T]) -> T:
    """``read()`` (saved pieces of ``what`` into an object), naming the files when they do not
    fit: torch and the sharded objects raise ValueError, KeyError, ... on a crafted index."""
    try:
        return read()
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(
            f"{ckpt / shard_section_name(what, 0)}.json (and the other ranks'): the saved "
            f"{what} pieces do not fit the {what} they are loaded into: {exc}"
        ) from exc


def _load_model(
    ckpt: Path, manifest: Manifest, model: nn.Module, sharded: Any, strict: bool
) -> None:
    where = str(ckpt / "model.safetensors")
    if is_sharded_in(manifest, "model"):
        meta, reader = read_sharded(ckpt, manifest, "model")
        if sharded is not None:
            _from_pieces(ckpt, "model", partial(sharded.load_sharded_state, meta, reader))
            return
        full = _from_pieces(ckpt, "model", lambda: {k: reader.full(k) for k in reader.keys()})  # noqa: SIM118
        load_model(model, full, strict, where)
    elif (sd := _section(ckpt, manifest, "model", strict)) is not None:
        if sharded is not None:
            sharded.load_state_dict(sd)
        else:
            load_model(model, sd, strict, where)


def _load_optimizer(
    ckpt: Path, manifest: Manifest, model: nn.Module | None, opt: Any, sharded: Any, strict: bool
) -> None:
    where = str(ckpt / "optimizer.json")
    if is_sharded_in(manifest, "optimizer"):
        meta, reader = read_sharded(ckpt, manifest, "optimizer")
        if sharded is not None:
            _from_pieces(ckpt, "optimizer", partial(sharded.load_sharded_state, meta, reader))
        else:
            names = [n for n, _ in unwrap(model).named_parameters()] if model is not None else None
            read = partial(full_optimizer_state, meta, reader, names)
            state = _from_pieces(ckpt, "optimizer", read)
            load_into(opt, state, "optimizer", where)
    elif (sd := _section(ckpt, manifest, "optimizer", strict)) is not None:
        load_into(sharded if sharded is not None else opt, sd, "optimizer", where)


def _load_objects(ckpt: Path, manifest: Manifest, objects: dict[str, Any], strict: bool) -> None:
    state = _section(ckpt, manifest, OBJECTS, strict)
    if state is None:
        return
    where = str(ckpt / f"{OBJECTS}.json")
    for name in objects:
        if name in state:
            restore_object(objects, name, state[name], where)
            continue
        message = f"{where} holds no object {name!r} (it holds: {', '.join(state) or 'none'})"
        if strict:
            raise CheckpointError(f"{message}; pass strict=False to load the rest")
        warnings.warn(f"{message}; not restored (strict=False)", stacklevel=5)


def _restore(ckpt: Path, session: Session, to: _Targets) -> CheckpointInfo:
    manifest = read_manifest(ckpt)
    notes: list[str] = []
    sharded_model, sharded_opt = as_sharded(to.model, to.optimizer)
    if to.model is not None:
        _load_model(ckpt, manifest, to.model, sharded_model, to.strict)
    if to.optimizer is not None:
        _load_optimizer(ckpt, manifest, to.model, to.optimizer, sharded_opt, to.strict)
    if to.scheduler is not None and (sd := _section(ckpt, manifest, "scheduler", to.strict)):
        load_into(to.scheduler, sd, "scheduler", str(ckpt / "scheduler.json"))
    if to.objects:
        _load_objects(ckpt, manifest, to.objects, to.strict)
    own = _rank_state(ckpt, manifest, session, notes)
    if to.sampler is not None:
        if own["sampler"] is None:
            raise CheckpointError(f"{ckpt} holds no sampler state (save() got no sampler)")
        load_into(to.sampler, own["sampler"], "sampler", str(ckpt))
    if to.rng and "rng" in own:
        name = rank_section_name(session.rank)
        try:
            notes.extend(restore_rng(own["rng"], str(ckpt / f"{name}.json")))
        except ValueError as exc:  # names the file
            raise CheckpointError(str(exc)) from None
    extra = structure.unflatten(manifest.extra, {}, str(ckpt / "manifest.json"))
    return CheckpointInfo(
        ckpt, manifest.step, extra, manifest.world_size, tuple(notes), own["sampler"]
    )


def _agree(session: Session, error: BaseException | None) -> None:
    if session.store is None:
        return
    session.publish(f"loaded/{session.rank}", {"ok": error is None, "error": repr(error)})
    failed = [
        (r, got["error"])
        for r in range(session.size)
        if not (got := session.wait(f"loaded/{r}"))["ok"]
    ]
    if error is None and failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank} failed to load the checkpoint: {message}")


def _restore_everywhere(session: Session, ckpt: Path, targets: _Targets) -> CheckpointInfo:
    try:
        info = _restore(ckpt, session, targets)
    except BaseException as exc:
        _agree(session, exc)
        raise
    _agree(session, None)
    return info


def load(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    sampler: Any = None,
    strict: bool = True,
    path: str | os.PathLike[str] | None = None,
    rng: bool = True,
    group: Any = None,
    objects: dict[str, Any] | None = None,
) -> CheckpointInfo | None:
    """Restore the newest committed checkpoint of ``directory``; collective over ``group``.

    Args:
        directory: The directory given to ``save``.
        model: Module (or DDP / DataParallel wrapper) to load into.
        optimizer: Optimizer to load into (built over ``model``'s parameters, same order).
        scheduler: LR scheduler to load into.
        sampler: Object with ``load_state_dict``; gets this rank's saved state.
        strict: Model keys and shapes must match exactly and requested sections must exist;
            with False, what matches is loaded and a warning lists the rest.
        path: Load this checkpoint (a directory, or its name in ``directory``) instead of
            the newest one.
        rng: Restore this rank's torch / CUDA / numpy / Python random generators.
        group: Process group (every rank of it must call ``load``).
        objects: Name -> object with ``load_state_dict``, or a value, as given to
            ``save(objects=...)``: a tensor is restored in place, any other value replaced
            in this dict.

    Returns:
        What was loaded, or None when ``directory`` holds no committed checkpoint yet.

    Raises:
        ChecksumError: naming the file whose size or checksum differs from the manifest.
        StateMismatchError: listing missing, unexpected and mismatched model keys.
        CheckpointError: for incomplete or unsafe checkpoints, and on every rank when any
            rank failed.
    """
    check_targets(
        "load",
        directory,
        group,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
    )
    objects = check_objects("load", objects)
    strict, rng = check_bool("strict", strict, where="load"), check_bool("rng", rng, where="load")
    if path is not None:
        check_path("path", path, where="load")
    targets = _Targets(model, optimizer, scheduler, sampler, objects or {}, rng, strict)
    background.wait()  # this process's asynchronous save, if one is in flight
    session = open_session(group)
    try:
        chosen = session.share("chosen", partial(_resolve, directory, path))
        if chosen is None:
            return None
        return _restore_everywhere(session, Path(chosen), targets)
    finally:
        session.close()
