"""Diagnostics of a running job: one timeline of every rank, with each step's critical path.

``Job(timeline_dir=DIR)`` (or ``phalanx run --timeline DIR``) records, on every rank, its
phases, its waits and every collective and point-to-point operation, with its clock's offset
to rank 0's; ``phalanx timeline DIR`` merges them into one Chrome / Perfetto trace and says,
per step, which rank and phase the step waited on. See ``docs/timeline.md``.

The modules, in the order a newcomer reads them:

- ``events.py``: what a timeline is made of (segments, waits, operations of one rank);
- ``recorder.py``: recording on a rank (appends while training, a file write per chunk);
- ``job_timeline.py``: how a job switches recording on (argument, environment);
- ``rank_log.py``: one rank's file;
- ``clock_math.py``: offsets from ping-pong timestamps (pure); ``clock_sync.py`` measures them;
- ``merge.py``: the ranks' files on rank 0's clock, operations matched across ranks;
- ``critical_path.py``: the walk and each step's verdict (pure);
- ``chrome_trace.py``: the trace; ``profiler_merge.py``: torch profiler traces folded in;
- ``trace_check.py``: the trace's structure checked; ``plot.py``: the picture;
- ``timeline_cli.py``: ``phalanx timeline``.
"""

from __future__ import annotations

from phalanx.diagnostics.critical_path import CriticalPath, StepCritical, critical_path
from phalanx.diagnostics.merge import Run, load_run
from phalanx.diagnostics.recorder import TimelineRecorder

__all__ = [
    "CriticalPath",
    "Run",
    "StepCritical",
    "TimelineRecorder",
    "critical_path",
    "load_run",
]
