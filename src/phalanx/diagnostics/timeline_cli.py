"""``phalanx timeline RUN``: one trace of every rank, clock-aligned, with each step's critical path.

RUN is the folder a job recorded its timeline into (``Job(timeline_dir=RUN)`` or ``phalanx run
--timeline RUN``), or a folder holding it as ``timeline/``. The command merges the ranks' files
onto rank 0's clock, walks the critical path, writes one Chrome / Perfetto JSON trace (``-o``,
default ``RUN/trace.json``), and prints the clock alignment's error and a table: per step, the
rank and phase the step waited on, how much longer than typical it was there, and how long the
other ranks waited. ``--profiles DIR`` folds in the torch profiler traces of the same ranks
(``Job(profile_dir=DIR)``); ``--plot [PNG]`` draws the table (needs matplotlib); ``--check``
checks the trace's structure and exits 1 on a problem. Exit code 2: no timeline in RUN.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from phalanx.diagnostics.chrome_trace import build_trace
from phalanx.diagnostics.critical_path import CriticalPath, critical_path
from phalanx.diagnostics.merge import Run, clock_report, load_run
from phalanx.diagnostics.profiler_merge import find_profiles, load_profile, profile_events
from phalanx.diagnostics.trace_check import check_trace

__all__ = ["main", "make_trace", "print_summary"]


def make_trace(run: Run, profiles: str | None = None) -> tuple[dict[str, Any], CriticalPath]:
    """The trace of ``run`` (with the profiler traces in ``profiles``) and its critical path."""
    path = critical_path(run.ranks)
    doc = build_trace(run, path)
    if profiles:
        found = find_profiles(profiles)
        for rank, file in sorted(found.items()):
            if rank in run.clocks:
                events = profile_events(load_profile(file), rank, run.clocks[rank], run.t0)
                doc["traceEvents"].extend(events)
        doc["otherData"]["phalanx"]["profiles"] = sorted(found)
    return doc, path


def print_summary(run: Run, path: CriticalPath, out: Any = None) -> None:
    """The clock line, the per-step table and who was critical how often."""
    out = out or sys.stdout
    clock = clock_report(run)
    n = len(run.ranks)
    if n < 2:
        print("clock: one rank, nothing to align", file=out)
    elif clock["measured"]:
        print(
            f"clock: {n} ranks aligned to rank 0 (NTP-style ping-pongs); error <= "
            f"{clock['max_error_ms']:.3f} ms at each measurement, offsets moved <= "
            f"{clock['max_drift_ms']:.3f} ms between measurements",
            file=out,
        )
    else:
        print("clock: offsets not measured on every rank (shown unaligned)", file=out)
    print(
        f"{'step':>6} {'rank':>5} {'phase':<14}{'excess ms':>10}{'on path ms':>11}"
        f"{'step ms':>9}{'others waited ms':>17}",
        file=out,
    )
    for s in path.steps:
        print(
            f"{s.step:>6} {s.rank:>5} {s.phase:<14}{1e3 * s.excess:>10.2f}{1e3 * s.on_path:>11.2f}"
            f"{1e3 * (s.end - s.start):>9.2f}{1e3 * s.others_waited:>17.2f}",
            file=out,
        )
    counts = Counter((s.rank, s.phase) for s in path.steps)
    if counts:
        top = ", ".join(f"rank {r} {p} x{c}" for (r, p), c in counts.most_common(6))
        print(f"critical in {len(path.steps)} steps: {top}", file=out)


def main(argv: list[str] | None = None) -> int:
    """``phalanx timeline RUN [-o TRACE] [--profiles DIR] [--plot [PNG]] [--check]``."""
    parser = argparse.ArgumentParser(prog="phalanx timeline", description=__doc__.split("\n")[0])
    parser.add_argument("run", metavar="RUN", help="the timeline folder the job recorded into")
    parser.add_argument("-o", "--output", metavar="TRACE", help="default: RUN/trace.json")
    parser.add_argument("--profiles", metavar="DIR", help="torch profiler traces to fold in")
    plot_help = "draw the per-step critical path (default RUN/critical_path.png)"
    parser.add_argument("--plot", nargs="?", const="", metavar="PNG", help=plot_help)
    parser.add_argument("--check", action="store_true", help="check the trace's structure")
    parser.add_argument("--json", metavar="PATH", help="also write the per-step table as JSON")
    args = parser.parse_args(argv)
    try:
        run = load_run(args.run)
    except (FileNotFoundError, ValueError) as exc:
        print(f"phalanx timeline: {exc}", file=sys.stderr)
        return 2
    doc, path = make_trace(run, args.profiles)
    output = Path(args.output) if args.output else Path(args.run) / "trace.json"
    output.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"trace: {output} ({len(doc['traceEvents'])} events; open it in ui.perfetto.dev)")
    print_summary(run, path)
    if args.json:
        Path(args.json).write_text(json.dumps(doc["otherData"]["phalanx"], indent=1))
    if args.plot is not None:
        from phalanx.diagnostics.plot import plot_critical_path

        png = Path(args.plot) if args.plot else Path(args.run) / "critical_path.png"
        plot_critical_path(path, png, title=f"critical path per step: {args.run}")
        print(f"plot: {png}")
    if args.check:
        problems = check_trace(doc, world_size=len(run.ranks))
        for problem in problems[:20]:
            print(f"trace problem: {problem}", file=sys.stderr)
        if problems:
            return 1
        print("trace structure: ok")
    return 0
