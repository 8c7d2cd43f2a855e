"""The merged run as one Chrome / Perfetto JSON trace (the Trace Event Format).

Layout (open it in https://ui.perfetto.dev or chrome://tracing):

- one process per rank, ``rank <r> (<host>)``, pid ``r + 1``, sorted by rank, with threads:
  ``phases`` (tid 1: data, forward, backward, optimizer, other, each with its step),
  ``waits`` (tid 2: the training thread blocked on communication), and ``ops``, ``ops 2``, ...
  (tid 3 on: every collective and point-to-point operation, on as many lanes as overlapping
  asynchronous operations need, since slices of one thread must nest);
- flow arrows (``ph`` ``s`` / ``f``, category ``waited-for``) from the last rank to arrive at an
  operation to each rank that arrived earlier and so waited for it;
- a process ``critical path`` (pid ``world_size + 1``): thread ``steps`` has one slice per
  step naming its critical rank and phase, thread ``path`` the path's stretches, and two
  counters per step, ``critical rank`` and ``others waited (ms)``;
- ``otherData.phalanx``: the format version, the trace's zero on rank 0's clock
  (``t0_unix_s``), the clock alignment's method and residual error, and the per-step table.

Timestamps are microseconds since ``t0_unix_s`` on rank 0's clock.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from phalanx.diagnostics.critical_path import CriticalPath, StepCritical
from phalanx.diagnostics.events import Op, RankTimeline
from phalanx.diagnostics.merge import Run, clock_report

__all__ = ["FIRST_OP_TID", "PHASES_TID", "VERSION", "WAITS_TID", "build_trace", "rank_pid"]

VERSION = 1
PHASES_TID, WAITS_TID, FIRST_OP_TID = 1, 2, 3
FLOW_CAT = "waited-for"


def rank_pid(rank: int) -> int:
    """The trace's process id of ``rank`` (pid 0 is left alone: viewers treat it specially)."""
    return rank + 1


def build_trace(run: Run, path: CriticalPath) -> dict[str, Any]:
    """The trace of ``run`` with its critical ``path`` (see the module's docstring)."""
    t0 = run.t0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = []
    slots: dict[tuple[str, int], tuple[int, Op]] = {}  # (key, rank) -> (tid, op)
    for _, tl in sorted(run.ranks.items()):
        events += _rank_events(tl, us, slots)
    events += _flows(slots, us)
    events += _critical_events(run.world_size + 1, path, us)
    meta = {
        "version": VERSION,
        "t0_unix_s": t0,
        "world_size": run.world_size,
        "clock": clock_report(run),
        "steps": [_step_row(s) for s in path.steps],
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"phalanx": meta}}


def _meta(pid: int, tid: int, name: str, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"ph": "M", "pid": pid, "tid": tid, "name": name, "args": {key: value}}


def _rank_events(
    tl: RankTimeline, us: Any, slots: dict[tuple[str, int], tuple[int, Op]]
) -> list[dict[str, Any]]:
    pid = rank_pid(tl.rank)
    out = [
        _meta(pid, 0, "process_name", f"rank {tl.rank} ({tl.host})"),
        _meta(pid, 0, "process_sort_index", tl.rank),
        _meta(pid, PHASES_TID, "thread_name", "phases"),
        _meta(pid, WAITS_TID, "thread_name", "waits"),
    ]
    for seg in tl.segments:
        step = {"step": seg.step}
        out.append(_slice(pid, PHASES_TID, seg.phase, "phase", us(seg.start), us(seg.end), step))
    for start, end in tl.waits:
        ms = {"ms": round(1e3 * (end - start), 3)}
        out.append(_slice(pid, WAITS_TID, "wait", "wait", us(start), us(end), ms))
    lanes: list[float] = []  # each lane's last end
    for op in tl.ops:
        start, end = us(op.start), us(op.end if op.end is not None else op.start)
        lane = next((i for i, last in enumerate(lanes) if last <= start), len(lanes))
        if lane == len(lanes):
            lanes.append(end)
            name = "ops" if lane == 0 else f"ops {lane + 1}"
            out.append(_meta(pid, FIRST_OP_TID + lane, "thread_name", name))
        lanes[lane] = end
        tid = FIRST_OP_TID + lane
        cat = "p2p" if op.is_p2p else "collective"
        out.append(_slice(pid, tid, _op_name(op), cat, start, end, _op_args(op)))
        if op.key:
            slots[(op.key, tl.rank)] = (tid, op)
    return out


def _slice(
    pid: int, tid: int, name: str, cat: str, ts: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    dur = round(max(0.0, end - ts), 3)
    where = {"pid": pid, "tid": tid, "ts": ts, "dur": dur}
    return {"ph": "X", "name": name, "cat": cat, **where, "args": args}


def _op_name(op: Op) -> str:
    if not op.is_p2p:
        return op.op
    side = {"send": "to", "recv": "from"}.get(op.op, "with")
    who = "any" if op.peer is not None and op.peer < 0 else str(op.peer)
    return f"{op.op} {side} {who}"


def _op_args(op: Op) -> dict[str, Any]:
    args: dict[str, Any] = {"group": op.group, "seq": op.seq, "shape": op.shape, "site": op.site}
    if op.args:
        args["args"] = op.args
    if op.end is None:
        args["completed"] = False
    if op.key:
        args["key"] = op.key
    if op.last_rank is not None and op.last_start is not None:
        args["last_to_arrive"] = op.last_rank
        args["waited_ms"] = round(1e3 * max(0.0, op.last_start - op.start), 3)
    if op.idle:
        args["idle"] = True
    return args


def _flows(slots: dict[tuple[str, int], tuple[int, Op]], us: Any) -> list[dict[str, Any]]:
    """An arrow from the last rank's slice to each slice of a rank that waited for it."""
    out: list[dict[str, Any]] = []
    for (key, rank), (tid, op) in sorted(slots.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        last = op.last_rank
        if last is None or last == rank or op.end is None or (key, last) not in slots:
            continue
        last_tid, last_op = slots[(key, last)]
        if last_op.end is None:
            continue
        flow_id = len(out) // 2 + 1
        name = f"rank {rank} waited for rank {last}"
        ts_s = _inside(us(last_op.start), us(last_op.end), us(last_op.start))
        ts_f = _inside(us(op.start), us(op.end), us(last_op.start))
        common = {"cat": FLOW_CAT, "id": flow_id, "name": name}
        out.append({"ph": "s", "pid": rank_pid(last), "tid": last_tid, "ts": ts_s, **common})
        out.append({"ph": "f", "bp": "e", "pid": rank_pid(rank), "tid": tid, "ts": ts_f, **common})
    return out


def _inside(start: float, end: float, t: float) -> float:
    """``t`` moved strictly inside ``[start, end]`` where it can be (a flow binds to the slice
    that encloses its timestamp)."""
    margin = min(0.5, (end - start) / 2)
    return round(min(max(t, start + margin), end - margin), 3)


def _critical_events(pid: int, path: CriticalPath, us: Any) -> list[dict[str, Any]]:
    out = [
        _meta(pid, 0, "process_name", "critical path"),
        _meta(pid, 0, "process_sort_index", -1),
        _meta(pid, 1, "thread_name", "steps"),
        _meta(pid, 2, "thread_name", "path"),
    ]
    prev_end = float("-inf")
    for s in path.steps:
        start = max(us(s.start), prev_end)
        end = max(us(s.end), start)
        prev_end = end
        name = f"step {s.step}: rank {s.rank} {s.phase} (+{1e3 * s.excess:.1f} ms)"
        out.append(_slice(pid, 1, name, "critical", start, end, _step_row(s)))
        out.append(_counter(pid, "critical rank", start, {"rank": s.rank}))
        waited = {"mean": round(1e3 * s.others_waited, 3)}
        out.append(_counter(pid, "others waited (ms)", start, waited))
    for piece in reversed(path.pieces):
        name = f"rank {piece.rank} {piece.phase}"
        args = {"rank": piece.rank, "phase": piece.phase, "step": piece.step}
        out.append(_slice(pid, 2, name, "critical", us(piece.start), us(piece.end), args))
    return out


def _counter(pid: int, name: str, ts: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "C", "pid": pid, "tid": 0, "name": name, "ts": ts, "args": args}


def _step_row(s: StepCritical) -> dict[str, Any]:
    by_rank: dict[int, float] = defaultdict(float)
    for (rank, _), seconds in s.path.items():
        by_rank[rank] += seconds
    return {
        "step": s.step,
        "rank": s.rank,
        "phase": s.phase,
        "excess_ms": round(1e3 * s.excess, 3),
        "on_path_ms": round(1e3 * s.on_path, 3),
        "step_ms": round(1e3 * (s.end - s.start), 3),
        "others_waited_ms": round(1e3 * s.others_waited, 3),
        "path_ms_by_rank": {str(r): round(1e3 * v, 3) for r, v in sorted(by_rank.items())},
    }
