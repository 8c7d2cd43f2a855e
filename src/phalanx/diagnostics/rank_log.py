"""One rank's timeline on disk: ``rank<r>.timeline.jsonl``, appended a chunk at a time.

One JSON object per line, each with a ``kind``:

- ``header``: ``version``, ``rank``, ``world_size``, ``host``, ``pid``, ``started``;
- ``sync``: a clock sample (``at``, ``offset``, ``rtt``; :mod:`.clock_math`);
- ``events``: what was recorded since the last chunk: ``marks`` (``[time, phase]``: the phase
  the loop entered, null when it stopped timing; ``"~name"`` relabels the stretch the previous
  mark opened), ``steps`` (``[time, step]``: the step count the job reached), ``waits``
  (``[end, seconds]``: the training thread was blocked), ``ops`` (``[group, seq, op, shape,
  args, site, start, end, peer, idle]``);
- ``close``: ``at``, when the recorder closed.

Times are the rank's own ``time.time()``. A file cut short (a rank killed mid-write) loses its
last line only: :func:`read_rank_log` skips a line it cannot parse.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from phalanx.diagnostics.clock_math import ClockSample
from phalanx.diagnostics.events import Op

__all__ = ["SUFFIX", "RankLog", "RankLogWriter", "find_rank_logs", "rank_path", "read_rank_log"]

SUFFIX = ".timeline.jsonl"
VERSION = 1


def rank_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its timeline in ``directory``."""
    return Path(directory) / f"rank{rank}{SUFFIX}"


class RankLogWriter:
    """Writes one rank's file: the header when made (replacing an older file), then lines."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.path, "w")  # noqa: SIM115 - kept open till close
        self.write("header", version=VERSION, **header)

    def write(self, kind: str, **fields: Any) -> None:
        """Append one line and flush it (nothing once closed)."""
        if self._file is None:
            return
        self._file.write(json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class RankLog:
    """One rank's file, read back (local times)."""

    rank: int
    world_size: int
    host: str = "?"
    pid: int = 0
    started: float = 0.0
    marks: list[tuple[float, str | None]] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    """``(start, end)``."""
    ops: list[Op] = field(default_factory=list)
    syncs: list[ClockSample] = field(default_factory=list)
    closed: float | None = None


def find_rank_logs(run: str | os.PathLike[str]) -> list[Path]:
    """The rank files of a run: in ``run`` itself, or in its ``timeline/`` folder."""
    root = Path(run)
    for folder in (root, root / "timeline"):
        found = sorted(folder.glob(f"rank*{SUFFIX}"))
        if found:
            return found
    return []


def read_rank_log(path: str | os.PathLike[str]) -> RankLog:
    """Read a rank's file.

    Raises:
        ValueError: the file has no header line (not a timeline file).
    """
    log: RankLog | None = None
    for line in Path(path).read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed rank
        if doc.get("kind") == "header":
            log = RankLog(
                int(doc["rank"]),
                int(doc["world_size"]),
                str(doc.get("host", "?")),
                int(doc.get("pid", 0)),
                float(doc.get("started", 0.0)),
            )
        elif log is not None:
            _apply(log, doc)
    if log is None:
        raise ValueError(f"{path}: not a phalanx timeline file (no header line)")
    return log


def _apply(log: RankLog, doc: dict[str, Any]) -> None:
    kind = doc.get("kind")
    if kind == "sync":
        log.syncs.append(ClockSample(float(doc["at"]), float(doc["offset"]), float(doc["rtt"])))
    elif kind == "close":
        log.closed = float(doc["at"])
    elif kind == "events":
        for t, name in doc.get("marks", []):
            _mark(log.marks, float(t), name)
        log.steps.extend((float(t), int(n)) for t, n in doc.get("steps", []))
        log.waits.extend((float(e) - float(s), float(e)) for e, s in doc.get("waits", []))
        log.ops.extend(_op(row) for row in doc.get("ops", []))


def _mark(marks: list[tuple[float, str | None]], t: float, name: str | None) -> None:
    if isinstance(name, str) and name.startswith("~"):
        if marks and marks[-1][1] is not None:  # the open stretch counts as that phase
            marks[-1] = (marks[-1][0], name[1:])
        return
    marks.append((t, name))


def _op(row: list[Any]) -> Op:
    group, seq, op, shape, args, site, start, end, peer, idle = row
    end = None if end is None else float(end)
    peer = None if peer is None else int(peer)
    return Op(
        str(group),
        int(seq),
        str(op),
        str(shape),
        str(args),
        str(site),
        float(start),
        end,
        peer,
        bool(idle),
    )
