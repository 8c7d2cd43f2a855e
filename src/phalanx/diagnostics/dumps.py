"""Every flight-recorder dump among some directories and files, phalanx's and torch's, by rank.

phalanx's ranks write ``rank-<r>.json`` (``PHALANX_DUMP_DIR``); torch's write ``<prefix><rank>``,
a pickle or JSON (see :mod:`.torch_flight`). A file's kind is told by its content, not its
name. In a directory, files that are neither kind are passed over (a rendezvous file, a log);
a file named on the command line must be a dump. When torch's Flight Recorder was on beside
phalanx's, a rank's records from both are merged: their groups differ (``torch pg 0`` beside
``0``), so each is compared with itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from phalanx.diagnostics.flight import Record, load_dump
from phalanx.diagnostics.torch_flight import (
    TorchDump,
    looks_like_torch_dump,
    merge_sites,
    read_torch_dump,
)

__all__ = ["read_dumps"]


def read_dumps(
    paths: Sequence[str | os.PathLike[str]],
) -> tuple[dict[int, list[Record]], list[str]]:
    """Each rank's records (both kinds merged, oldest first) and lines saying what was read.

    Raises:
        ValueError: naming the file, for an unreadable or unsafe dump, a named file that is no
            dump, or two dumps of one kind for the same rank.
    """
    ours: dict[int, list[Record]] = {}
    torch_dumps: dict[int, TorchDump] = {}
    seen: dict[tuple[str, int], Path] = {}
    for path, named in _files(paths):
        with path.open("rb") as f:
            head = f.read(1)
        if head == b"{" and _is_phalanx(path):
            rank, recs = load_dump(path)
            _claim(seen, "phalanx", rank, path)
            ours[rank] = recs
        elif looks_like_torch_dump(path, head):
            dump = read_torch_dump(path)
            _claim(seen, "torch Flight Recorder", dump.rank, path)
            torch_dumps[dump.rank] = dump
        elif named:
            raise ValueError(
                f"{path}: neither a phalanx dump (rank-<r>.json) nor a torch Flight Recorder dump "
                "(<prefix><rank>, pickle or JSON)"
            )
    merge_sites(list(torch_dumps.values()))
    records: dict[int, list[Record]] = {}
    for rank, recs in ours.items():
        records.setdefault(rank, []).extend(recs)
    for rank, dump in torch_dumps.items():
        records.setdefault(rank, []).extend(dump.records)
    for recs in records.values():
        recs.sort(key=lambda r: r.start)
    return records, _summary(sorted(ours), list(torch_dumps.values()))


def _files(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[Path, bool]]:
    """(file, named on the command line) for each file given and each file in each directory."""
    found: list[tuple[Path, bool]] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += [(f, False) for f in sorted(p.iterdir()) if f.is_file()]
        elif p.is_file():
            found.append((p, True))
        else:
            raise ValueError(f"{p}: no such file or directory")
    return found


def _is_phalanx(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and "records" in doc and "rank" in doc


def _claim(seen: dict[tuple[str, int], Path], kind: str, rank: int, path: Path) -> None:
    if (kind, rank) in seen:
        raise ValueError(
            f"two {kind} dumps for rank {rank}: {seen[kind, rank]} and {path}; "
            "pass one per rank (e.g. the pickle or the JSON form, not both)"
        )
    seen[kind, rank] = path


def _summary(ours: list[int], torch_dumps: list[TorchDump]) -> list[str]:
    lines = [f"read phalanx flight records of rank(s) {ours}"] if ours else []
    if torch_dumps:
        ranks = sorted(d.rank for d in torch_dumps)
        sites = (
            "with call sites"
            if all(d.has_frames for d in torch_dumps)
            else "without call sites (a JSON dump has no stacks: a skipped collective shows "
            "where the ops first differ, which can be later; the pickle form has them)"
        )
        lines.append(f"read torch Flight Recorder dumps of rank(s) {ranks}, {sites}")
        if any("gloo" in d.backends for d in torch_dumps):
            lines.append(
                "note: torch's gloo entries carry no completion state: 'completed' below means the "
                "collective finished, perhaps with an error (a timeout)"
            )
    return lines
