"""``save``: every rank writes its own small file and a share of the replicated state; rank 0
commits.

Sequence (see ``atomic.py`` for what makes each step crash-safe):

1. each rank takes its state dicts and hashes the replicated tensors' layout; one short
   collective agrees on a token and compares the hashes (``spread.py``); rank 0 creates
   ``.tmp-step-NNNNNN-<token>`` and tells the others through the store;
2. every rank writes ``rank-NNNNN.{json,safetensors}`` (RNG, sampler) and its share of the
   replicated files (model / optimizer / scheduler / objects; all of them on rank 0 when the
   layouts differ), and publishes the files' checksums in the rendezvous store;
3. rank 0 writes the replicated sections' JSON files, collects the other ranks' digests from
   the store, writes ``manifest.json``, renames the directory, updates ``latest``, prunes;
4. rank 0 publishes the result; the others wait for it on the store (long timeout, no
   collective: a slow write cannot make them hit the collective timeout).

Each rank encodes its files' headers right after the collective, on the caller's thread, so a
value that cannot be stored fails there. With ``async_=True`` the tensors this rank writes are
first copied to host staging buffers (``staging.py``), and everything after the collective
that touches the disk or the store runs on a background thread (``background.py``): it needs
no collective, so it never interleaves with the training thread's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from phalanx._check import check_bool, check_instance, check_int
from phalanx.checkpoint import atomic, background, catalog, rng, spread, structure
from phalanx.checkpoint.args import check_targets
from phalanx.checkpoint.atomic import Buffer
from phalanx.checkpoint.format import encode
from phalanx.checkpoint.limits import MAX_DEPTH, MAX_JSON_ENV, deeper_than, max_json_bytes
from phalanx.checkpoint.manifest import MANIFEST, CheckpointError, FileEntry, Manifest
from phalanx.checkpoint.sections import Section, parallel, unwrap
from phalanx.checkpoint.sharded import as_sharded, shard_section
from phalanx.checkpoint.staging import Staged, stage
from phalanx.checkpoint.stateful import check_objects, object_state
from phalanx.checkpoint.sync import Session, group_rank, open_session

__all__ = ["OBJECTS", "rank_section_name", "save"]

OBJECTS = "objects"
"""The section of the named objects given to ``save(objects=...)``."""

log = logging.getLogger(__name__)


def rank_section_name(rank: int) -> str:
    """Section holding rank ``rank``'s own state (``rank-00001``)."""
    return f"rank-{rank:05d}"


@dataclass(frozen=True)
class _Request:
    """What a save commits, besides the files."""

    step: int
    extra: dict[str, Any]
    keep_last: int | None


class _HasState(Protocol):
    """A sampler (or anything) whose ``state_dict()`` is saved per rank."""

    def state_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _State:
    """What ``save`` was given to write."""

    model: nn.Module | None
    optimizer: Any
    scheduler: Any
    sampler: _HasState | None
    objects: dict[str, Any]
    rng_state: dict[str, Any]


@dataclass(frozen=True)
class _Files:
    """This rank's files as buffers to write: its own, and its share of the replicated ones."""

    own: list[tuple[str, Sequence[Buffer]]]
    replicated: list[tuple[str, Sequence[Buffer]]]
    sections: list[str]
    """The replicated sections' names (for the manifest; on rank 0)."""
    staged: Staged | None = None


def _check(step: int, keep_last: int | None, extra: Any) -> Any:
    step = check_int("step", step, min=0, where="save")
    if keep_last is not None:
        check_int("keep_last", keep_last, min=1, where="save", fix="or None to keep all")
    if extra is not None:
        check_instance("extra", extra, dict, "a dict of JSON-able values", where="save")
    tree, _ = structure.flatten(extra or {}, "save(extra=...)", allow_tensors=False)
    if deeper_than(tree, MAX_DEPTH - 1):  # the manifest holds it one level down
        raise ValueError(f"save(extra=...) nests deeper than {MAX_DEPTH - 1} levels; flatten it")
    return tree


def _file_list(sections: list[Section]) -> list[tuple[str, Sequence[Buffer]]]:
    return [(name, bufs) for section in sections for name, bufs in section.files().items()]


def _write_files(
    tmp: Path, files: list[tuple[str, Sequence[Buffer]]], faulty: int
) -> dict[str, FileEntry]:
    """Write ``files`` in parallel; the fault point applies to the one at index ``faulty``."""
    calls = [
        partial(atomic.write_file, tmp / name, bufs, faulty=i == faulty)
        for i, (name, bufs) in enumerate(files)
    ]
    return dict(zip((name for name, _ in files), parallel(calls)))


def _replicated(state: _State) -> list[Section]:
    sections = []
    sharded_model, sharded_opt = as_sharded(state.model, state.optimizer)
    if state.model is not None and sharded_model is None:
        sections.append(Section.of("model", unwrap(state.model).state_dict(), "model state"))
    if state.optimizer is not None and sharded_opt is None:
        sections.append(Section.of("optimizer", state.optimizer.state_dict(), "optimizer state"))
    if state.scheduler is not None:
        sections.append(Section.of("scheduler", state.scheduler.state_dict(), "scheduler state"))
    if state.objects:
        saved = {name: object_state(obj) for name, obj in state.objects.items()}
        sections.append(Section.of(OBJECTS, saved, "objects state"))
    return sections


def _own_sections(rank: int, state: _State) -> list[Section]:
    """This rank's RNG and sampler state, and its pieces of sharded state."""
    sampler_state = None if state.sampler is None else state.sampler.state_dict()
    own = {"rank": rank, "rng": state.rng_state, "sampler": sampler_state}
    sections = [Section.of(rank_section_name(rank), own, "rank state")]
    sharded = zip(("model", "optimizer"), as_sharded(state.model, state.optimizer))
    return sections + [shard_section(what, rank, obj) for what, obj in sharded if obj]


def _plan(rank: int, state: _State, replicas_equal: bool) -> tuple[list[Section] | Exception, str]:
    """The replicated sections this rank may write a share of, and its fingerprint of them
    (``spread.py``), which the ranks compare when the save opens."""
    if not replicas_equal and rank != 0:
        return [], f"rank 0 writes alone (rank {rank})"
    try:
        sections = _replicated(state)
    except Exception as exc:
        return exc, f"failed on rank {rank}"
    return sections, spread.fingerprint(sections) if replicas_equal else "rank 0 writes alone"


def _prepare(
    rank: int,
    state: _State,
    replicated: list[Section] | Exception,
    writers: int,
    snapshot: bool,
) -> _Files | Exception:
    """The files this rank writes (the exception instead, to be reported to the others):
    its own, and its share of the replicated ones when ``writers`` ranks share them.

    With ``snapshot`` every tensor is first copied to a host staging buffer (``staging.py``),
    so that training may change the originals while the files are written.
    """
    try:
        if isinstance(replicated, Exception):
            raise replicated
        own = _own_sections(rank, state)
        part = spread.share(replicated, rank, writers) if rank < writers else spread.Share()
        sections = own + [section for _, section in part.tensor_files]
        staged = stage(sections) if snapshot else None
        if staged is not None:
            sections = staged.sections
        files: list[tuple[str, Sequence[Buffer]]] = [
            (name, encode(section.tensors))
            for (name, _), section in zip(part.tensor_files, sections[len(own) :])
        ]
        files += [(name, [raw]) for name, raw in part.indexes]
        return _Files(_file_list(sections[: len(own)]), files, part.sections, staged)
    except Exception as exc:
        return exc


def _files(answer: dict[str, Any]) -> dict[str, FileEntry]:
    """The files of a peer's ``written`` answer (raises on a malformed one)."""
    out = {k: FileEntry.from_json(v) for k, v in answer["files"].items()}
    checked = {k: e for k, e in out.items() if e is not None}
    if len(checked) != len(out):
        raise TypeError("a file entry is a byte count and a crc32c (or sha256) hex digest")
    return checked


def _committed_path(answer: dict[str, Any]) -> str:
    if not isinstance(answer["path"], str):
        raise TypeError("a committed checkpoint's path is a string")
    return answer["path"]


def _collect_peers(session: Session, files: dict[str, FileEntry]) -> None:
    for r in range(1, session.size):
        got = session.wait(f"written/{r}", _files)
        if not got["ok"]:
            raise CheckpointError(f"rank {r} could not write its checkpoint files: {got['error']}")
        files.update(_files(got))


def _write_and_commit(
    session: Session, tmp: Path, req: _Request, files: _Files, written: dict[str, FileEntry]
) -> Path:
    entries = dict(written)
    _collect_peers(session, entries)
    atomic.fault("before-manifest")
    manifest = Manifest(req.step, session.size, entries, files.sections, req.extra)
    raw = manifest.to_json()
    if len(raw) > max_json_bytes():  # load would refuse it
        raise ValueError(
            f"{MANIFEST} would be {len(raw)} bytes, over the {max_json_bytes()}-byte limit "
            f"(save(extra=...) too large?); set {MAX_JSON_ENV} to raise it"
        )
    atomic.write_file(tmp / MANIFEST, [raw])
    path = catalog.commit(tmp, req.step, session.token)
    catalog.prune(tmp.parent, req.keep_last, path)
    return path


def _rank0(session: Session, tmp: Path, req: _Request, files: Any, own: Any) -> Path:
    try:
        if isinstance(own, BaseException):
            raise own
        path = _write_and_commit(session, tmp, req, files, own)
    except BaseException as exc:
        session.publish("committed", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        atomic.remove_tree(tmp)
        raise
    session.publish("committed", {"ok": True, "path": str(path)})
    return path


def _peer(session: Session, own: dict[str, FileEntry] | BaseException) -> Path:
    if isinstance(own, BaseException):
        session.publish(f"written/{session.rank}", {"ok": False, "error": repr(own)})
        raise own
    files = {k: v.to_json() for k, v in own.items()}
    session.publish(f"written/{session.rank}", {"ok": True, "files": files})
    result = session.wait("committed", _committed_path)
    if not result["ok"]:
        raise CheckpointError(f"rank 0 could not commit the checkpoint: {result['error']}")
    return Path(result["path"])


def _temp_dir(root: Path, step: int, token: str) -> str:
    return str(catalog.make_temp_dir(root, step, token))


def _own_files(tmp: Path, rank: int, files: _Files | Exception) -> Any:
    """Write this rank's files, its own and its share of the replicated ones, all at once (so
    the small files' fsyncs overlap the large writes); return their entries or the exception."""
    if not tmp.is_dir():
        return CheckpointError(
            f"rank {rank} does not see {tmp}, which rank 0 created: the checkpoint directory "
            f"must be on a filesystem that every rank shares"
        )
    if isinstance(files, Exception):
        return files
    try:
        if files.staged is not None:
            files.staged.ready()
        return _write_files(tmp, files.own + files.replicated, faulty=len(files.own))
    except Exception as exc:
        return exc


def _write(session: Session, root: Path, req: _Request, files: _Files | Exception) -> Path:
    """Steps 1-4 of the module docstring, after the files are prepared: store only."""
    tmp = Path(session.share("tmpdir", partial(_temp_dir, root, req.step, session.token)))
    own = _own_files(tmp, session.rank, files)
    if session.rank != 0:
        return _peer(session, own)
    start = time.perf_counter()
    path = _rank0(session, tmp, req, files, own)
    log.info("saved checkpoint %s in %.2f s", path, time.perf_counter() - start)
    return path


def _write_and_close(
    session: Session, root: Path, req: _Request, files: _Files | Exception
) -> Path:
    try:
        return _write(session, root, req, files)
    finally:
        session.close()


def save(
    directory: str | os.PathLike[str],
    step: int,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    sampler: Any = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = 3,
    group: Any = None,
    rng_state: dict[str, Any] | None = None,
    objects: dict[str, Any] | None = None,
    async_: bool = False,
    replicas_equal: bool = True,
) -> Path:
    """Write a checkpoint of ``step`` into ``directory``; collective over ``group``.

    Args:
        directory: Where checkpoints live (one ``step-NNNNNN`` directory each); on a
            filesystem that every rank sees.
        step: Training step (an int >= 0); names the checkpoint.
        model: A module, or a DDP / DataParallel wrapper (its ``.module`` is saved). A ZeRO-3
            model is saved as per-rank pieces (see :mod:`phalanx.checkpoint.sharded`).
        optimizer: Any ``torch.optim.Optimizer`` (tensors to safetensors, the rest JSON); a
            ZeRO optimizer (or one over a ZeRO-3 model) is saved as per-rank pieces, which
            load at any world size.
        scheduler: An LR scheduler (its state dict must be JSON-able, tensors allowed).
        sampler: Anything with JSON-able ``state_dict()`` / ``load_state_dict()``; per rank.
        extra: JSON-able dict returned by :func:`load` as ``CheckpointInfo.extra``.
        keep_last: Committed checkpoints to keep (older ones are deleted after the commit);
            None keeps all.
        group: Process group (None: the default group, or one process without
            torch.distributed). Every rank of it must call ``save``.
        rng_state: This rank's generator states to record, as ``rng.capture()`` gives them
            (default: the states now). ``phalanx.Job`` passes those of its resume point.
        objects: Name -> anything with ``state_dict()`` (torch's ``Stateful``; its state
            tensors and JSON-able values) or such a value itself, saved once (rank 0's) in the
            ``objects`` section; ``load(objects=...)`` restores them (see ``stateful.py``).
        async_: Copy the state to host staging buffers (pinned memory for CUDA tensors,
            reused by later saves), return, and write and commit on a background thread
            (``background.py``); changes made to the state after ``save`` returns are not
            written. The next ``save``, :func:`wait`, ``load`` and ``Job.close`` wait for that
            write and raise its error. A crash during it leaves the previous checkpoint in
            force, as with a synchronous save.
        replicas_equal: The replicated state (model, optimizer, scheduler, objects; not ZeRO
            pieces) is equal on every rank, as under data parallelism, so every rank writes a
            share of its files (``spread.py``). Ranks whose state differs in names, shapes or
            dtypes are detected and rank 0 writes alone; pass False where the *values* may
            differ, so that rank 0 writes its own copy of all of it.

    Returns:
        The committed checkpoint directory (with ``async_``: the directory it will be
        committed as; :func:`wait` returns it once it is).

    Raises:
        TypeError: naming the key of a value that cannot be stored without pickle.
        CheckpointError: on every rank when any rank failed to write (with ``async_``, also
            the failure of the previous asynchronous save).
    """
    check_targets(
        "save",
        directory,
        group,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
    )
    objects = check_objects("save", objects)
    req = _Request(step, _check(step, keep_last, extra), keep_last)
    async_ = check_bool("async_", async_, where="save")
    replicas_equal = check_bool("replicas_equal", replicas_equal, where="save")
    background.wait()  # the previous asynchronous save, raising its error
    rng_state = rng.capture() if rng_state is None else rng_state
    state = _State(model, optimizer, scheduler, sampler, objects or {}, rng_state)
    root = Path(directory)
    replicated, fingerprint = _plan(group_rank(group)[0], state, replicas_equal)
    session = open_session(group, fingerprint)
    writers = session.size if session.agreed else 1
    files = _prepare(session.rank, state, replicated, writers, snapshot=async_)
    if not async_ or isinstance(files, Exception):  # a failure is reported at once
        return _write_and_close(session, root, req, files)
    work = partial(_write_and_close, session.for_thread(), root, req, files)
    background.start(f"checkpoint step {step} in {root}", work)
    return root / atomic.step_name(step)
