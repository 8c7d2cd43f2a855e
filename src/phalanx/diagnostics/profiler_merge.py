"""Fold torch profiler traces of the same ranks into the timeline's trace.

``Job(profile_dir=DIR)`` writes ``DIR/rank<r>.pt.trace.json`` per rank (:mod:`phalanx.train.
profiling`). torch's profiler (Kineto) stamps events in microseconds after
``baseTimeNanoseconds``, on the wall clock, the same clock the timeline records with; each
event is moved onto rank 0's clock with that rank's :class:`~.clock_math.ClockModel` and onto
the rank's process in the trace. The profiler's threads (CPU threads, GPU streams) become
threads ``torch: <name>`` of that process, numbered from :data:`FIRST_TID`; its flow arrows
(kernel launches to kernels) keep their pairs, with ids moved out of the timeline's range.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from phalanx.diagnostics.chrome_trace import rank_pid
from phalanx.diagnostics.clock_math import ClockModel

__all__ = ["FIRST_TID", "find_profiles", "load_profile", "profile_events"]

FIRST_TID = 1000
_ID_STRIDE = 10**9
_NAME = re.compile(r"rank(\d+)\.pt\.trace\.json$")


def find_profiles(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """``{rank: path}`` of the profiler traces in ``directory``."""
    found = {}
    for path in sorted(Path(directory).glob("rank*.pt.trace.json")):
        m = _NAME.search(path.name)
        if m:
            found[int(m.group(1))] = path
    return found


def profile_events(
    doc: dict[str, Any], rank: int, clock: ClockModel, t0: float
) -> list[dict[str, Any]]:
    """The events of one rank's profiler trace ``doc``, placed on the timeline's rank ``rank``
    (times on rank 0's clock, microseconds after ``t0``)."""
    base = float(doc.get("baseTimeNanoseconds", 0)) / 1e9
    pid = rank_pid(rank)
    tids: dict[tuple[Any, Any], int] = {}
    named: set[int] = set()
    out: list[dict[str, Any]] = []
    for ev in doc.get("traceEvents", []):
        ph = ev.get("ph")
        if ph == "M":
            if ev.get("name") == "thread_name":
                tid = _tid(tids, ev)
                named.add(tid)
                out.append(_thread_name(pid, tid, (ev.get("args") or {}).get("name", "thread")))
            continue  # the profiler's own process names and sort indices would clash
        if "ts" not in ev:
            continue
        moved = dict(ev, pid=pid, tid=_tid(tids, ev))
        ts = float(ev["ts"])
        # In microseconds throughout: seconds since 1970 as a float keep only 0.24 us, which
        # would unnest the profiler's own slices.
        offset = clock.offset_at(base + ts / 1e6)
        moved["ts"] = round(ts + (base - t0 + offset) * 1e6, 3)
        if ph in ("s", "t", "f") and isinstance(ev.get("id"), int):
            moved["id"] = ev["id"] + (rank + 1) * _ID_STRIDE
        out.append(moved)
    for tid in set(tids.values()) - named:
        out.append(_thread_name(pid, tid, f"thread {tid - FIRST_TID}"))
    return out


def _tid(tids: dict[tuple[Any, Any], int], ev: dict[str, Any]) -> int:
    key = (ev.get("pid"), ev.get("tid"))
    if key not in tids:
        tids[key] = FIRST_TID + len(tids)
    return tids[key]


def _thread_name(pid: int, tid: int, name: str) -> dict[str, Any]:
    args = {"name": f"torch: {name}"}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": args}


def load_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a profiler trace (JSON)."""
    doc: dict[str, Any] = json.loads(Path(path).read_text())
    return doc
