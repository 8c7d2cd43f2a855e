"""Diagnostics of a running job: what every collective did, where ranks diverge or hang, and one
timeline of every rank with each step's critical path.

Two halves, both on top of the wire (:mod:`phalanx.comm`), which never imports them: the wire
offers one hook (:mod:`phalanx.comm.watch`) and ``import phalanx`` installs :mod:`.tracking` on
it, so every collective and point-to-point operation is recorded and checked.

**Tracking, on every rank, always on** (see ``docs/communication.md``). The modules, in the order
a newcomer reads them:

- ``tracking.py``: the wire's watcher: sequence numbers, records, the progress thread, blame;
- ``flight.py``: the flight record of each operation, and the ring of the last ones;
- ``pairing.py``: which calls the ranks paired wrongly (pure): the rule of every mismatch report;
- ``snapshot.py``: the progress each rank publishes; ``mismatch_check.py``: the always-on
  check (rolling CRCs compared with the neighbours'); ``fingerprint.py`` and ``validation.py``:
  the full check before each collective (``PHALANX_DEBUG=1``);
- ``call_ring.py`` and ``rank_files.py``: the per-rank files a dead or stuck rank leaves;
- ``blame.py``: a failed collective's error (who is behind, who died, what differs);
- ``watchdog.py`` and ``hang_report.py``: the live hang report;
- ``dumps.py``, ``torch_flight.py`` (with ``plain_pickle.py``) and ``diagnose_cli.py``:
  ``phalanx diagnose``, over phalanx's dumps and torch's Flight Recorder's.

**The timeline.** ``Job(timeline_dir=DIR)`` (or ``phalanx run --timeline DIR``) records, on
every rank, its phases, its waits and every collective and point-to-point operation, with its
clock's offset to rank 0's; ``phalanx timeline DIR`` merges them into one Chrome / Perfetto
trace and says, per step, which rank and phase the step waited on. See ``docs/timeline.md``.

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
