"""The checkpoints of a directory: which is the newest committed one, commit, keep-last-k.

``directory/latest`` names the committed checkpoint. Without a usable pointer (deleted, or
naming a directory that is gone), the newest ``step-*`` directory whose files all match its
manifest is taken. Temporary (``.tmp-*``) and incomplete (no manifest) directories are never
loaded; each is named in a warning. Only rank 0 calls the mutating functions here.

Re-saving a step is as crash-safe as saving a new one. The old ``step-N`` is renamed aside to
``.replaced-step-N-<token>`` before the new one takes its name, and deleted only after
``latest`` is updated. A kill between the two renames leaves the aside as the only copy of step
N: :func:`committed` counts it as step N while ``step-N`` is missing (so ``load`` falls back to
it, verified), the next :func:`commit` renames it back, and :func:`prune` deletes an aside only
once its ``step-N`` is complete again (or keep-last counts it out like any checkpoint).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

from phalanx._check import check_path
from phalanx.checkpoint.atomic import (
    LATEST,
    fault,
    fsync_dir,
    read_latest,
    remove_tree,
    step_name,
    step_of,
    write_latest,
)
from phalanx.checkpoint.manifest import MANIFEST, CheckpointError, read_manifest, verify_files

__all__ = ["commit", "committed", "latest", "make_temp_dir", "prune", "stranded_copy"]

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
# ".tmp-replaced-": the asides of phalanx versions before the re-save fix, recognised as well
_ASIDE = re.compile(r"\.(?:tmp-)?replaced-(step-\d{6,})-[0-9a-f]+")


def _complete(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file()


def _aside_of(entry: str) -> str | None:
    """The step directory name an aside (``.replaced-step-N-<token>``) held, else None."""
    m = _ASIDE.fullmatch(entry)
    return m.group(1) if m else None


def _stranded(directory: Path, entry: str) -> str | None:
    """The step name of ``entry`` if it is the complete old copy of a step whose re-save was
    killed between its two renames (its ``step-N`` is not complete), else None."""
    kept = _aside_of(entry)
    if kept is None or _complete(directory / kept) or not _complete(directory / entry):
        return None
    return kept


def committed(directory: Path, *, warn: bool = False) -> list[tuple[int, Path]]:
    """Complete ``step-*`` checkpoints in ``directory``, newest first.

    Args:
        directory: The checkpoint directory.
        warn: Warn about each temporary or incomplete directory that is skipped.
    """
    found = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        step = step_of(entry)
        if step is not None and _complete(path):
            found.append((step, path))
        elif (kept := _stranded(directory, entry)) is not None:
            found.append((int(kept.removeprefix("step-")), path))
        elif _aside_of(entry) is not None:
            continue  # superseded: its step was saved again; prune deletes it
        elif warn and (step is not None or entry.startswith(TMP_PREFIX)) and path.is_dir():
            kind = "temporary" if step is None else "incomplete (no manifest.json)"
            warnings.warn(
                f"skipping {kind} checkpoint directory {path}: a save did not finish "
                f"there (a crash or a kill); it is never loaded",
                stacklevel=3,
            )
    return sorted(found, key=lambda item: item[0], reverse=True)


def stranded_copy(directory: Path, name: str) -> Path | None:
    """The aside holding step ``name`` (``step-000123``) when a re-save of it was killed
    between its two renames, so that ``load(path=name)`` finds it; else None."""
    if step_of(name) is None or not directory.is_dir():
        return None
    found = (directory / e for e in os.listdir(directory) if _stranded(directory, e) == name)
    return next(found, None)


def _fallback(directory: Path, candidates: list[tuple[int, Path]]) -> Path | None:
    for _, path in candidates:
        try:
            verify_files(path, read_manifest(path))
            return path
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint {path}: {exc}", stacklevel=3)
    return None


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None if there is none.

    ``directory/latest`` decides; without a usable one, the newest ``step-*`` directory whose
    files match its manifest (checksums) is taken, with a warning.
    """
    d = Path(check_path("directory", directory, where="latest"))
    if not d.is_dir():
        return None
    candidates = committed(d, warn=True)
    name = read_latest(d)
    if name is not None and _complete(d / name):
        return d / name
    if name is not None:
        warnings.warn(
            f"{d / LATEST} names {name}, which is missing or incomplete; falling back "
            f"to the newest complete checkpoint",
            stacklevel=2,
        )
    return _fallback(d, candidates)


def make_temp_dir(directory: Path, step: int, token: str) -> Path:
    """Create ``directory/.tmp-step-NNNNNN-<token>`` (and ``directory`` if needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{TMP_PREFIX}{step_name(step)}-{token}"
    tmp.mkdir()
    return tmp


def _recover(directory: Path) -> None:
    """Give each stranded aside its step name back (see the module docstring)."""
    for entry in os.listdir(directory):
        if (kept := _stranded(directory, entry)) is not None and not os.path.lexists(
            directory / kept
        ):
            log.warning("restoring %s as %s (a re-save of it was interrupted)", entry, kept)
            os.rename(directory / entry, directory / kept)


def commit(tmp: Path, step: int, token: str) -> Path:
    """Rename the finished ``tmp`` to ``step-NNNNNN`` and point ``latest`` at it.

    An existing directory of the same name (a checkpoint of this step saved before, or one
    whose ``latest`` update a crash prevented) is renamed aside first and deleted once
    ``latest`` is updated; a crash in between leaves it loadable (module docstring).
    """
    fsync_dir(tmp)
    fault("before-rename")
    directory, name = tmp.parent, step_name(step)
    _recover(directory)
    final, aside = directory / name, None
    if os.path.lexists(final):
        aside = directory / f"{REPLACED_PREFIX}{name}-{token}"
        os.rename(final, aside)
        fault("between-renames")
    os.rename(tmp, final)
    fsync_dir(directory)
    fault("before-latest")
    write_latest(directory, name, token)
    if aside is not None:
        remove_tree(aside)
    return final


def _leftover(directory: Path, entry: str) -> bool:
    """A temporary file or directory of an interrupted save, or a superseded aside."""
    if (kept := _aside_of(entry)) is not None:
        return _complete(directory / kept)
    return entry.startswith((TMP_PREFIX, f".{LATEST}{TMP_PREFIX}"))


def prune(directory: Path, keep_last: int | None, current: Path) -> None:
    """Delete all but ``keep_last`` committed checkpoints (always keeping ``current``) and
    leftover temporary directories of interrupted saves (never the only copy of a step)."""
    for entry in os.listdir(directory):
        if _leftover(directory, entry):
            log.info("removing %s, left by an interrupted save", directory / entry)
            remove_tree(directory / entry)
    if keep_last is None:
        return
    others = [p for _, p in committed(directory) if p != current]
    for path in others[keep_last - 1 :]:
        log.info("removing %s (keep_last=%d)", path, keep_last)
        remove_tree(path)
    fsync_dir(directory)
