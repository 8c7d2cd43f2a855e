"""SIGTERM as a preemption: the job commits its last finished step, then exits.

Schedulers (SLURM's preemption and ``scancel``, Kubernetes, ``phalanx run`` passing on its own
SIGTERM) send SIGTERM to every process of the job and SIGKILL a grace period later. A job with a
``checkpoint_dir`` catches the first SIGTERM (:class:`Preemption`); the ranks agree on one step
to stop after, save it synchronously and exit with status 143 (128 + SIGTERM), as a killed
process would, so a requeued job resumes exactly there. A second SIGTERM kills at once.

**Agreeing on the step, without a collective per step.** Each rank notices its signal at a
step boundary ``s_r`` (after an optimizer step) and writes ``s_r`` to the rendezvous store; from
then on it reads the others' at each boundary (one store round trip; nothing at all before a
signal). Once every rank's value is there, the job stops after step ``S = max(s_r) + 1``. Every
step ends in a collective every rank joins (a gradient all-reduce, a pipeline's transfers), so
a rank at the boundary after step ``S`` has seen every rank enter step ``S`` and so past the
boundary at which it wrote: it sees every value no later than at ``S``, and no rank passes
``S`` without knowing it. This needs the signal on every rank, which is what the schedulers
above do.

Not for parameter servers (whose workers are not in step) nor live recovery (which survives
lost ranks instead). ``Job(save_on_sigterm=False)`` keeps SIGTERM's default action, and a
handler the program set itself is left alone.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
from types import FrameType

from phalanx.comm.group import World, signed_store

__all__ = ["EXIT_STATUS", "Preemption"]

log = logging.getLogger(__name__)

EXIT_STATUS = 128 + signal.SIGTERM
"""The status a preempted job exits with (what a shell reports for a process SIGTERM killed)."""

_JOBS = itertools.count()  # every rank makes its jobs in the same order: their keys agree


class Preemption:
    """Catches SIGTERM for one job and says after which step it stops.

    Args:
        world: The job's world (all its ranks take part).
        enabled: Catch SIGTERM (only from the main thread, and only where SIGTERM still has
            its default action).
    """

    def __init__(self, world: World, enabled: bool) -> None:
        self.world = world
        self.signalled = False
        """A SIGTERM arrived."""
        self.stop_after: int | None = None
        """The agreed step to stop after, once known."""
        self._prefix = f"phalanx/preempt/{next(_JOBS)}/"
        self._said = False
        self._previous: object = None
        main = threading.current_thread() is threading.main_thread()
        if enabled and main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    @property
    def installed(self) -> bool:
        """Whether this job catches SIGTERM."""
        return self._previous is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled:  # a second one: the default action, at once
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        self.signalled = True

    def due(self, step: int) -> bool:
        """At the boundary after optimizer step ``step``: True when the job stops now."""
        if not self.signalled:
            return False
        if self.stop_after is None:
            self.stop_after = self._agree(step)
            if self.stop_after is not None and self.world.is_main:
                log.warning("SIGTERM: the job stops after step %d, saved", self.stop_after)
        return self.stop_after is not None and step >= self.stop_after

    def _agree(self, step: int) -> int | None:
        """The step to stop after once every rank has said where it saw its signal."""
        store = signed_store()
        if store is None or self.world.world_size == 1:
            return step
        if not self._said:
            store.put(f"{self._prefix}{self.world.rank}", step)
            self._said = True
        keys = [f"{self._prefix}{r}" for r in range(self.world.world_size)]
        if not store.exists(keys):
            return None
        seen = [s for s in store.get_present(keys, int) if s is not None]
        return max(seen) + 1 if len(seen) == len(keys) else None

    def close(self) -> None:
        """Give SIGTERM back its previous handler."""
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None
