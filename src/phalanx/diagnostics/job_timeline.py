"""The timeline recorder as an observer of ``phalanx.Job``: how recording is switched on.

A job records its timeline when made with ``Job(timeline_dir=DIR)``, or when its process has
``PHALANX_TIMELINE_DIR=DIR`` in the environment, which ``phalanx run --timeline DIR`` sets for
every worker (so an unchanged script records too). The argument wins over the variable. Then
each rank writes ``DIR/rank<r>.timeline.jsonl`` (:mod:`.rank_log`), and ``phalanx timeline DIR``
merges them. Two more variables tune the clock measurement (:mod:`.clock_sync`):

- ``PHALANX_TIMELINE_SYNC_EVERY``: steps between measurements (default 500; 0: only at start
  and at each checkpoint);
- ``PHALANX_TIMELINE_SYNC_ROUNDS``: ping-pongs per rank per measurement (default 16).

The clocks are measured when the job is made (every rank makes its job at the same point), at
every ``save()`` and every ``SYNC_EVERY`` steps, where every rank steps together; a
parameter-server job measures at start only, a live-recovery job never (its members come and
go), and says so in the trace's metadata (an error bound of "not measured").

:func:`phalanx.train.observers.start` imports this module the first time a job is made; it
registers :func:`attach` with the job's observer registry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.diagnostics.recorder import TimelineRecorder

# The one module of phalanx.diagnostics that imports the training loop: it is the timeline's
# plug into Job, registered with the job's observer registry, which imports it by name when the
# first Job is made (tests/unit/test_layers.py allows this import, and only here).
from phalanx.train import observers
from phalanx.train.observers import JobView

__all__ = ["ENV_DIR", "ENV_SYNC_EVERY", "ENV_SYNC_ROUNDS", "attach", "current"]

ENV_DIR = "PHALANX_TIMELINE_DIR"
ENV_SYNC_EVERY = "PHALANX_TIMELINE_SYNC_EVERY"
ENV_SYNC_ROUNDS = "PHALANX_TIMELINE_SYNC_ROUNDS"

_current: list[TimelineRecorder] = []


def _env_int(env: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={raw!r} must be an integer >= {least} (default {default})")
    return value


def attach(view: JobView, env: Mapping[str, str] | None = None) -> TimelineRecorder | None:
    """A started recorder for the job ``view`` describes, if its timeline was asked for."""
    env = os.environ if env is None else env
    directory = view.timeline_dir or env.get(ENV_DIR, "").strip()
    if not directory:
        return None
    world = view.world
    recorder = TimelineRecorder(
        directory,
        rank=world.rank,
        world_size=world.world_size,
        device=world.device,
        sync_rounds=_env_int(env, ENV_SYNC_ROUNDS, 16, 1),
        sync_every=_env_int(env, ENV_SYNC_EVERY, 500, 0),
        lockstep=view.lockstep,
    )
    if not view.live:
        recorder.sync_clock()
    recorder.start()
    _current[:] = [recorder]
    return recorder


def current() -> TimelineRecorder | None:
    """The recorder of the last job made in this process with a timeline (None: none)."""
    return _current[0] if _current else None


observers.register(attach)
