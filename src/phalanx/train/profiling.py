"""Profile a few training steps with torch.profiler: one Chrome/Perfetto trace per rank.

``prof = profile("traces/")`` then ``prof.step()`` once per iteration. The schedule skips ``wait``
steps (start-up noise: allocations, lazy initialisation), warms the profiler up for ``warmup``
steps (its own start-up cost stays out of the trace), records ``steps`` steps, writes
``traces/rank{r}.pt.trace.json`` and switches itself off, so the rest of the run pays nothing.
Open the files in https://ui.perfetto.dev or chrome://tracing; one file per rank shows stragglers
and where each rank waits in communication.

With ``trace_dir=None`` every method returns at once: the training loop can call ``step()``
unconditionally.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.group import world

__all__ = ["Profiler", "profile"]

log = logging.getLogger(__name__)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return world().rank


class Profiler:
    """Profile ``steps`` steps after ``wait`` + ``warmup``; one trace per rank in ``trace_dir``.

    A torch.profiler session driven by :meth:`step` (call it after each iteration); inert when
    ``trace_dir`` is None. Use it as a context manager around the loop, or call :meth:`step`
    alone (the first call starts the schedule) and :meth:`stop` at the end in case the loop ran
    fewer steps than ``wait + warmup + steps`` (whatever was recorded is then written).

    Args:
        trace_dir: Folder for ``rank{r}.pt.trace.json``; None turns profiling off (no overhead).
        steps: Steps recorded.
        warmup: Steps the profiler runs but discards, before recording.
        wait: Steps skipped entirely at the start.
        record_shapes: Record operator input shapes.
        with_stack: Record Python stacks (larger traces, more overhead).
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike[str] | None,
        *,
        steps: int = 5,
        warmup: int = 1,
        wait: int = 1,
        record_shapes: bool = True,
        with_stack: bool = False,
    ) -> None:
        if steps < 1 or warmup < 0 or wait < 0:
            raise ValueError(
                f"profile(): need steps >= 1, warmup >= 0, wait >= 0; got steps={steps}, "
                f"warmup={warmup}, wait={wait}"
            )
        self.path = None if trace_dir is None else Path(trace_dir) / f"rank{_rank()}.pt.trace.json"
        """Where this rank's trace goes (None: profiling off)."""
        self.written = False
        """True once the trace file has been written."""
        self._done = trace_dir is None
        self._prof: Any = None
        self._schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=steps, repeat=1)
        self._record_shapes, self._with_stack = record_shapes, with_stack

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=self._schedule,
            on_trace_ready=self._export,
            record_shapes=self._record_shapes,
            with_stack=self._with_stack,
        )
        self._prof.start()

    def _export(self, prof: Any) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.written = True
        log.info("profiler trace written to %s", self.path)

    def step(self) -> None:
        """Mark the end of one iteration (the first call, outside ``with``, starts profiling)."""
        if self._done:
            return
        if self._prof is None:
            self._start()
            return
        self._prof.step()
        if self.written:  # the schedule is over: stop paying for the profiler
            self.stop()

    def stop(self) -> None:
        """End profiling now, writing what was recorded if the schedule was mid-way (idempotent)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
        self._done = True

    def __enter__(self) -> Profiler:
        if not self._done and self._prof is None:
            self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


profile = Profiler
"""``profile(trace_dir, steps=..., ...)``: the name torch.profiler users reach for (its
``profile`` is a class too); the same :class:`Profiler`."""
