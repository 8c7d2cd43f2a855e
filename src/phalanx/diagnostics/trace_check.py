"""Structural checks of a timeline trace, without a trace viewer.

:func:`check_trace` returns what is wrong with a trace :func:`~.chrome_trace.build_trace` made
(an empty list: nothing): every event well formed, slices of one thread properly nested, one
process per rank, every flow arrow with exactly one start and one end, each inside a slice of
its thread. :func:`ops_by_key` says which ranks hold each operation, to check that every
collective appears on every rank of its group. ``phalanx timeline --check`` runs both; the
tests run them on every trace they build, with or without Perfetto's trace processor.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["check_trace", "ops_by_key"]

_NUMBER = (int, float)
_EPS_US = 0.002  # rounding of timestamps to 1 ns


def check_trace(doc: dict[str, Any], world_size: int | None = None) -> list[str]:
    """Problems found in the trace ``doc`` (with ``world_size``: one process per rank too)."""
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    problems = [p for i, ev in enumerate(events) for p in _event_problems(i, ev)]
    if problems:
        return problems
    problems += _nesting(events)
    problems += _flows(events)
    if world_size is not None:
        problems += _processes(events, world_size)
    return problems


def _event_problems(i: int, ev: Any) -> list[str]:
    if not isinstance(ev, dict) or not isinstance(ev.get("ph"), str):
        return [f"event {i}: not an object with a ph"]
    if not isinstance(ev.get("pid"), int) or not isinstance(ev.get("tid"), int):
        return [f"event {i} ({ev.get('name')}): pid and tid must be integers"]
    if ev["ph"] != "M" and not isinstance(ev.get("ts"), _NUMBER):
        return [f"event {i} ({ev.get('name')}): no numeric ts"]
    if ev["ph"] == "X" and not (isinstance(ev.get("dur"), _NUMBER) and ev["dur"] >= 0):
        return [f"event {i} ({ev.get('name')}): a slice needs dur >= 0"]
    return []


def _slices(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[tuple[float, float]]]:
    out: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            out[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in out.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
    return out


def _nesting(events: list[dict[str, Any]]) -> list[str]:
    problems = []
    for (pid, tid), spans in _slices(events).items():
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start + _EPS_US:
                stack.pop()
            if stack and end > stack[-1] + _EPS_US:
                problems.append(f"pid {pid} tid {tid}: slice at {start} overlaps its parent")
                break
            stack.append(end)
    return problems


def _flows(events: list[dict[str, Any]]) -> list[str]:
    ends: dict[Any, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for ev in events:
        if ev["ph"] in ("s", "f"):
            ends[(ev.get("cat"), ev.get("id"))][ev["ph"]].append(ev)
    slices = _slices(events)
    problems = []
    for key, by in ends.items():
        if len(by["s"]) != 1 or len(by["f"]) != 1:
            problems.append(f"flow {key}: {len(by['s'])} starts and {len(by['f'])} ends")
            continue
        for ev in (by["s"][0], by["f"][0]):
            spans = slices.get((ev["pid"], ev["tid"]), [])
            if not any(a - _EPS_US <= ev["ts"] <= b + _EPS_US for a, b in spans):
                problems.append(f"flow {key}: its {ev['ph']} is inside no slice of its thread")
    return problems


def _processes(events: list[dict[str, Any]], world_size: int) -> list[str]:
    names = {
        ev["pid"]: ev["args"]["name"]
        for ev in events
        if ev["ph"] == "M" and ev.get("name") == "process_name"
    }
    ranks = sorted(n for n in names.values() if n.startswith("rank "))
    if len(ranks) != world_size:
        return [f"{len(ranks)} rank processes for world size {world_size}: {ranks}"]
    return []


def ops_by_key(doc: dict[str, Any]) -> dict[str, set[int]]:
    """``{operation key: pids holding it}`` of the trace's collectives and P2P operations."""
    out: dict[str, set[int]] = defaultdict(set)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X" and ev.get("cat") in ("collective", "p2p"):
            key = (ev.get("args") or {}).get("key")
            if key:
                out[key].add(ev["pid"])
    return dict(out)
