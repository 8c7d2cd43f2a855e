"""SIGTERM as a preemption: the job commits its last finished step, then exits.

Schedulers (SLURM's preemption and ``scancel``, Kubernetes, ``phalanx run`` passing on its own
SIGTERM) send SIGTERM to every process of the job and SIGKILL a grace period later. A job with a
``checkpoint_dir`` catches SIGTERM (:class:`Preemption`); the ranks agree on one step to stop
after, finish that step's loop body (an EMA update, a tracked counter, ``job.log``: what the
loop does after ``job.step()`` belongs to the step), save it synchronously before the next batch
is handed out and exit with status 143 (128 + SIGTERM), as a killed process would, so a
requeued job resumes exactly there. Further SIGTERMs are ignored: a worker under ``phalanx run``
inside a SLURM step gets one from SLURM and one from the launcher, milliseconds apart, and the
SIGKILL that follows the grace period still ends it. A signal the job never acted on (it came
after the last step) takes effect when the job closes: the previous handler is restored and
the signal raised again.

**Agreeing on the step, without a collective per step.** Each rank notices its signal at a
step boundary ``s_r`` (after an optimizer step) and writes ``s_r`` to the rendezvous store; from
then on it reads the others' at each boundary (one store round trip; nothing at all before a
signal). Once every rank's value is there, the job stops after step ``S = max(s_r) + 1``. Every
step ends in a collective every rank joins (a gradient all-reduce, a pipeline's transfers), so
a rank at the boundary after step ``S`` has seen every rank enter step ``S`` and so past the
boundary at which it wrote: it sees every value no later than at ``S``, and no rank passes
``S`` without knowing it. This needs the signal on every rank, which is what the schedulers
above do.

Only for strategies whose every step ends in a collective (``Strategy.lockstep``): not for
parameter servers, Hogwild, or local SGD and DiLoCo (which communicate every few steps), nor
live recovery (which survives lost ranks instead). ``Job(save_on_sigterm=False)`` keeps
SIGTERM's default action, and a handler the program set itself is left alone.
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
        self.stopping = False
        """The agreed step is done: the job saves and exits before its next batch."""
        self.acted = False
        """The job stopped for the signal (it saved and is exiting)."""
        self._prefix = f"phalanx/preempt/{next(_JOBS)}/"
        self._said = False
        self._previous: object = None
        main = threading.current_thread() is threading.main_thread()
        if enabled and main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True  # repeated ones too: the job is stopping already

    def reached(self, step: int) -> None:
        """At the boundary after optimizer step ``step``: sets :attr:`stopping` once the
        agreed step is done."""
        if not self.signalled or self.stopping:
            return
        if self.stop_after is None:
            self.stop_after = self._agree(step)
            if self.stop_after is not None and self.world.is_main:
                log.warning("SIGTERM: the job stops after step %d, saved", self.stop_after)
        self.stopping = self.stop_after is not None and step >= self.stop_after

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
        """Give SIGTERM back its previous handler, and raise a signal the job did not act on
        (it came after the job's last step) again, for that handler."""
        if self._previous is None or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
        self._previous = None
        if self.signalled and not self.acted:
            signal.raise_signal(signal.SIGTERM)
