"""torchrun's agent events (``--event-log-handler console``): JSON lines on stderr.

Each line has torchrun's shape (``torch.distributed.elastic.events.Event.serialize``): ``name``
``torchelastic.worker.status.<STATE>``, ``source`` WORKER or AGENT, ``timestamp`` and
``metadata``. phalanx records a START per worker when a generation starts, and at the end a
SUCCEEDED / FAILED / TERMINATED per worker and one for the agent. ``null`` (the default) and
``dynamic_rendezvous`` record nothing, as torchrun's handlers of those names.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Sequence

from phalanx.launch.config import LaunchConfig
from phalanx.launch.output import CONSOLE
from phalanx.launch.rendezvous import Rendezvous
from phalanx.launch.summary import Failure
from phalanx.launch.workers import Worker

__all__ = ["Events"]


class Events:
    """The event log of one node's agent."""

    def __init__(self, cfg: LaunchConfig, write: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.enabled = cfg.event_log_handler == "console"
        self._write = write or (lambda line: CONSOLE.line("stderr", line))
        self._rdzv: Rendezvous | None = None
        self._workers: Sequence[Worker] = ()

    def started(self, rdzv: Rendezvous, workers: Sequence[Worker]) -> None:
        """The workers of generation ``rdzv.generation`` were started."""
        self._rdzv, self._workers = rdzv, workers
        for worker in workers:
            self._record("START", "WORKER", worker)

    def replaced(self, dead: Worker, new: Worker) -> None:
        """``--recovery live``: ``dead`` failed and ``new`` started in its slot."""
        self._record("FAILED", "WORKER", dead)
        self._record("START", "WORKER", new)

    def ended(self, failure: Failure | None) -> None:
        """The job ended here: succeeded (``failure`` None) or failed for good."""
        for worker in self._workers:
            state = "SUCCEEDED" if worker.returncode in (None, 0) else "FAILED"  # live: lost
            if failure is not None:
                state = "FAILED" if worker.spec.rank == failure.rank else "TERMINATED"
            self._record(state, "WORKER", worker)
        self._record("SUCCEEDED" if failure is None else "FAILED", "AGENT", None)

    def _record(self, state: str, source: str, worker: Worker | None) -> None:
        if not self.enabled:
            return
        rdzv = self._rdzv
        extra: dict[str, object] = {
            "group_world_size": rdzv.nnodes if rdzv else None,
            "entry_point": os.path.basename(self.cfg.script if self.cfg.no_python else "python"),
        }
        if worker is not None:
            extra.update(
                local_rank=[worker.spec.local_rank],
                role_rank=[worker.spec.rank],
                role_world_size=[rdzv.world_size if rdzv else None],
                exit_code=[worker.returncode],
                worker_pid=[worker.pid],
            )
        metadata = {
            "run_id": rdzv.run_id if rdzv else None,
            "global_rank": worker.spec.rank if worker else None,
            "group_rank": self.cfg.node_rank,
            "worker_id": str(worker.pid) if worker else None,
            "role": self.cfg.role,
            "hostname": socket.getfqdn(),
            "state": state,
            "total_run_time": 0,
            "rdzv_backend": self.cfg.rdzv_backend,
            "raw_error": None,
            "metadata": json.dumps(extra),
            "agent_restarts": rdzv.generation if rdzv else 0,
            "duration_ms": None,
        }
        event = {
            "name": f"torchelastic.worker.status.{state}",
            "source": source,
            "timestamp": 0,
            "metadata": metadata,
        }
        self._write(json.dumps(event))
