"""The merged trace's structure: one process per rank, every collective on every rank, flows
well formed, slices nested; the profiler's traces folded in; the command; Perfetto if present."""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from phalanx.diagnostics import timeline_cli
from phalanx.diagnostics.chrome_trace import FIRST_OP_TID, build_trace, rank_pid
from phalanx.diagnostics.critical_path import critical_path
from phalanx.diagnostics.merge import Run, merge_logs
from phalanx.diagnostics.profiler_merge import FIRST_TID, profile_events
from phalanx.diagnostics.rank_log import RankLogWriter, rank_path, read_rank_log
from phalanx.diagnostics.trace_check import check_trace, ops_by_key
from tests.unit import timeline_sim as sim

SKEW = {1: 0.25, 2: -0.5, 3: 3.0}
DELAYS = {2: (1, "forward", 0.03), 4: (3, "backward", 0.04)}


def _run(buckets: int = 3) -> Run:
    return merge_logs(sim.ddp(4, 5, DELAYS, skew=SKEW, buckets=buckets))


def _trace(run: Run) -> dict[str, Any]:
    return build_trace(run, critical_path(run.ranks))


def test_the_trace_has_one_process_per_rank_and_every_collective_on_every_rank() -> None:
    run = _run()
    doc = _trace(run)
    assert check_trace(doc, world_size=4) == []
    held = ops_by_key(doc)
    assert len(held) == 5 * 3  # 5 steps of 3 buckets
    assert all(pids == {rank_pid(r) for r in range(4)} for pids in held.values()), held
    names = {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert [names[rank_pid(r)] for r in range(4)] == [f"rank {r} (sim)" for r in range(4)]
    assert "critical path" in names.values()


def test_overlapping_async_collectives_get_lanes_of_their_own() -> None:
    doc = _trace(_run(buckets=3))
    lanes = {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"}
    assert {FIRST_OP_TID, FIRST_OP_TID + 1} <= lanes  # buckets in flight together


def test_flows_go_from_the_last_rank_to_each_rank_that_waited() -> None:
    doc = _trace(_run(buckets=1))
    flows: dict[int, dict[str, dict[str, Any]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], {})[e["ph"]] = e
    assert flows and all(set(f) == {"s", "f"} for f in flows.values())
    # step 2's all-reduce (key 0#2): rank 1 came last, the three others waited for it
    into = sorted(
        f["f"]["pid"]
        for f in flows.values()
        if f["s"]["pid"] == rank_pid(1) and "1" in f["s"]["name"]
    )
    assert {rank_pid(r) for r in (0, 2, 3)} <= set(into)
    assert all(f["f"]["bp"] == "e" and f["s"]["ts"] <= f["f"]["ts"] + 1 for f in flows.values())


def test_the_metadata_states_the_clock_error_and_the_step_table() -> None:
    meta = _trace(_run())["otherData"]["phalanx"]
    assert meta["clock"]["measured"] is True
    assert meta["clock"]["max_error_ms"] == pytest.approx(0.005)  # rtt 1e-5 s / 2
    rows = {row["step"]: row for row in meta["steps"]}
    assert (rows[2]["rank"], rows[2]["phase"]) == (1, "forward")
    assert (rows[4]["rank"], rows[4]["phase"]) == (3, "backward")
    assert rows[4]["others_waited_ms"] == pytest.approx(40, abs=2)


def test_the_checker_finds_broken_traces() -> None:
    doc = _trace(_run())
    x = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "phase")
    bad = {"traceEvents": [*doc["traceEvents"], {**x, "ts": x["ts"] + x["dur"] / 2}]}
    assert any("overlaps" in p for p in check_trace(bad))
    flow = next(e for e in doc["traceEvents"] if e["ph"] == "s")
    assert any(
        "1 ends" in p or "2 starts" in p
        for p in check_trace({"traceEvents": [*doc["traceEvents"], flow]})
    )
    assert check_trace({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0}]})  # no dur
    assert check_trace(doc, world_size=5)  # four rank processes, not five


def test_a_rank_file_round_trips_and_survives_a_cut_line(tmp_path: Path) -> None:
    path = rank_path(tmp_path, 3)
    w = RankLogWriter(path, {"rank": 3, "world_size": 4, "host": "h", "pid": 9, "started": 1.0})
    w.write("sync", at=2.0, offset=0.5, rtt=0.001)
    op = ["0", 1, "all_reduce", "[2] float32", "SUM", "t.py:1 in f", 2.0, 2.5, None, False]
    marks = [[1.0, "data"], [1.5, "~forward"], [2.0, None]]
    w.write("events", marks=marks, steps=[[2.0, 1]], waits=[[2.5, 0.25]], ops=[op])
    w.close()
    with open(path, "a") as f:
        f.write('{"kind": "events", "marks": [[3.0, ')  # a rank killed mid-write
    log = read_rank_log(path)
    assert (log.rank, log.world_size, log.host) == (3, 4, "h")
    assert log.marks == [(1.0, "forward"), (2.0, None)]  # the relabel applied
    assert log.waits == [(2.25, 2.5)] and log.steps == [(2.0, 1)]
    assert log.ops[0].op == "all_reduce" and log.ops[0].end == 2.5
    assert log.syncs[0].offset == 0.5
    (tmp_path / "x.timeline.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="not a phalanx timeline"):
        read_rank_log(tmp_path / "x.timeline.jsonl")


def test_profiler_events_land_on_their_rank_on_rank_0s_clock() -> None:
    run = _run()
    base = 1000.0  # the profiler's base time, seconds; its events are microseconds after it
    doc = {
        "baseTimeNanoseconds": int(base * 1e9),
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 77, "tid": 5, "args": {"name": "main"}},
            {"ph": "X", "name": "aten::mm", "pid": 77, "tid": 5, "ts": 2_000_000.0, "dur": 10.0},
            {"ph": "s", "name": "launch", "id": 4, "pid": 77, "tid": 5, "ts": 2_000_001.0},
        ],
    }
    out = profile_events(doc, 3, run.clocks[3], run.t0)
    mm = next(e for e in out if e.get("name") == "aten::mm")
    local = base + 2.0
    assert mm["pid"] == rank_pid(3) and mm["tid"] == FIRST_TID
    assert mm["ts"] == pytest.approx((run.clocks[3].align(local) - run.t0) * 1e6, abs=1e-3)
    assert next(e for e in out if e["ph"] == "s")["id"] != 4  # out of the timeline's ids
    names = [e["args"]["name"] for e in out if e["ph"] == "M"]
    assert names == ["torch: main"]


def _write_logs(folder: Path) -> None:
    for log in sim.ddp(4, 6, DELAYS, skew=SKEW):
        w = RankLogWriter(
            rank_path(folder, log.rank), {"rank": log.rank, "world_size": 4, "host": "sim"}
        )
        for s in log.syncs:
            w.write("sync", at=s.at, offset=s.offset, rtt=s.rtt)
        ops = [
            [o.group, o.seq, o.op, o.shape, o.args, o.site, o.start, o.end, o.peer, o.idle]
            for o in log.ops
        ]
        waits = [[e, e - s] for s, e in log.waits]
        w.write("events", marks=log.marks, steps=log.steps, waits=waits, ops=ops)
        w.write("close", at=log.closed)
        w.close()


def test_the_command_writes_the_trace_and_prints_each_steps_critical_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_logs(tmp_path / "timeline")
    out = tmp_path / "t.json"
    table = tmp_path / "steps.json"
    assert timeline_cli.main([str(tmp_path), "-o", str(out), "--check", "--json", str(table)]) == 0
    text = capsys.readouterr().out
    assert "trace structure: ok" in text and "error <= 0.005 ms" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert rows[1][:3] == ["2", "1", "forward"] and rows[3][:3] == ["4", "3", "backward"]
    assert check_trace(json.loads(out.read_text()), world_size=4) == []
    assert json.loads(table.read_text())["steps"][1]["rank"] == 1


def test_the_command_says_when_there_is_no_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert timeline_cli.main([str(tmp_path)]) == 2
    assert "no rank*.timeline.jsonl" in capsys.readouterr().err


def test_the_plot_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _write_logs(tmp_path)
    assert timeline_cli.main([str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def _trace_processor_shell() -> str | None:
    """The trace processor binary, where one exists offline (the perfetto package downloads
    it on first use; PHALANX_TRACE_PROCESSOR names one)."""
    named = os.environ.get("PHALANX_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    if named:
        return named
    cached = glob.glob(
        os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell*")
    )
    return next((c for c in cached if os.access(c, os.X_OK) and not c.endswith(".tmp")), None)


def test_perfettos_trace_processor_reads_the_trace(tmp_path: Path) -> None:
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    shell = _trace_processor_shell()
    if shell is None:
        pytest.skip(
            "Perfetto's trace_processor_shell is not available offline (the perfetto package "
            "downloads it on first use); set PHALANX_TRACE_PROCESSOR to the binary"
        )
    run = _run(buckets=1)
    doc = _trace(run)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    config = tp_mod.TraceProcessorConfig(bin_path=shell)
    with tp_mod.TraceProcessor(trace=str(path), config=config) as tp:
        ranks = tp.query("select count(*) as n from process where name like 'rank %'")
        assert next(iter(ranks)).n == 4
        slices = tp.query("select count(*) as n from slice where category = 'collective'")
        assert next(iter(slices)).n == 5 * 4
        flows = tp.query("select count(*) as n from flow")
        assert next(iter(flows)).n == sum(e["ph"] == "s" for e in doc["traceEvents"])
