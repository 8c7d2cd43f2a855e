"""``--recovery live``: the agent enforces the job's decisions on its own workers.

A worker the job has given up on must not go on running: the survivors formed a generation
without it, and while its process lives the agent starts no replacement and waits for it at the
end (a SIGSTOPped worker waited on forever). So at every poll the agent SIGKILLs (the process
group of) each running worker that is

- **declared dead** by the job: the signed death record ``phalanx/live/dead/<slot>`` covers its
  incarnation (a survivor wrote it when the worker's heartbeat stopped or it did not reach a
  generation's agreement; a generation's membership leaves a member out only after that record);
- **stopped** (``T`` in ``/proc/<pid>/stat``: SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) for
  :data:`STOPPED_GRACE_S` seconds in a row: its heartbeat stops too, so the job would declare it
  dead anyway, seconds later, after its peers waited for it.

The kill is then an ordinary death (:mod:`.live`): the death record is written, a replacement
is claimed from ``--max-restarts``, and the summary names why the agent killed it. Only a
signed record counts: a forged or junk one is ignored (:mod:`phalanx.comm.signed`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from phalanx.comm.signed import SignedStore
from phalanx.launch.live_keys import INCARNATION_ENV, MEMBER_ENV, dead_incarnation
from phalanx.launch.rendezvous import store_call
from phalanx.launch.workers import Worker

__all__ = ["STOPPED_GRACE_S", "Enforcer", "stopped"]

STOPPED_GRACE_S = 2.0
"""How long a worker may stay stopped before its agent kills it (a debugger's ptrace stop,
``t``, is not a stop: it is left alone)."""


def stopped(pid: int) -> bool:
    """True when process ``pid`` is stopped by a signal (state ``T``); False if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


class Enforcer:
    """Kills this node's workers that the job declared dead or that stay stopped.

    Args:
        dead: Signer of the live keys in the worker store (where the death records are).
        log: The agent's log.
    """

    def __init__(self, dead: SignedStore, log: Callable[[str], None]) -> None:
        self.dead = dead
        self.log = log
        self.reasons: dict[int, str] = {}
        """``id()`` of each worker this agent killed -> why (for its death's summary)."""
        self._stopped_since: dict[int, float] = {}

    def poll(self, running: list[Worker]) -> None:
        """Kill every worker of ``running`` that is condemned (once each)."""
        for worker in running:
            if id(worker) in self.reasons:
                continue
            why = self._condemned(worker)
            if why is not None:
                self._kill(worker, why)

    def reason(self, worker: Worker) -> str | None:
        """Why this agent killed ``worker`` (None: it did not)."""
        return self.reasons.get(id(worker))

    def _condemned(self, worker: Worker) -> str | None:
        member, incarnation = worker.spec.env[MEMBER_ENV], int(worker.spec.env[INCARNATION_ENV])
        died = store_call(dead_incarnation, self.dead, member)
        if died is not None and died >= incarnation:
            return (
                f"the job declared it dead (signed record phalanx/live/dead/{member} = {died}: "
                f"its peers' heartbeat check or arrival deadline expired)"
            )
        now = time.monotonic()
        if not stopped(worker.pid):
            self._stopped_since.pop(id(worker), None)
            return None
        since = self._stopped_since.setdefault(id(worker), now)
        if now - since < STOPPED_GRACE_S:
            return None
        return f"it was stopped (SIGSTOP or SIGTSTP) for {now - since:.1f} s"

    def _kill(self, worker: Worker, why: str) -> None:
        self.reasons[id(worker)] = why
        member, incarnation = worker.spec.env[MEMBER_ENV], worker.spec.env[INCARNATION_ENV]
        self.log(
            f"rank {worker.spec.rank} (member {member}, incarnation {incarnation}, pid "
            f"{worker.pid}): {why}; killing it (SIGKILL) so that its slot can be replaced"
        )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
