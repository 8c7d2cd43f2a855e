"""A parameter-server worker: ``pull()`` parameters, compute gradients, ``push()`` them.

The worker's clock is the number of gradients it pushed. A pull asks every server for the
parameters to compute step ``clock`` and blocks until each answers: at once in ``async`` mode,
once the server's version is recent enough in ``sync`` / ``ssp`` mode. A background thread
sends a heartbeat to every server, so a worker that is computing a long step is not mistaken for
a lost one; a lock keeps its sends and the main thread's header/payload pairs apart.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from phalanx.parameter_server import wire
from phalanx.parameter_server.core import WorkerLost
from phalanx.parameter_server.protocol import Kind, encode_header
from phalanx.parameter_server.server import FLAG_FATAL, FLAG_FINAL, FLAG_PULL
from phalanx.parameter_server.shards import ShardPlan

__all__ = ["ServerError", "Worker", "WorkerHistory"]


class ServerError(RuntimeError):
    """A server answered with an error (a refused update, or a job it had to stop)."""


@dataclass
class WorkerHistory:
    """What this worker saw: for each pull, its clock and the oldest version it received."""

    pulls: list[tuple[int, int]] = field(default_factory=list)


class Worker:
    """One worker of a parameter-server job.

    Args:
        model: This worker's replica; :meth:`pull` writes the served parameters into it.
        plan: The shard plan every rank built from the same model.
        group: Servers are group ranks ``0 .. S-1``, workers ``S ..``.
        heartbeat: Seconds between heartbeats to every server (0 disables them).
    """

    def __init__(
        self, model: nn.Module, plan: ShardPlan, group: dist.ProcessGroup, *, heartbeat: float = 0.5
    ) -> None:
        self.model, self.plan, self.group = model, plan, group
        self.index = dist.get_rank(group) - plan.num_servers
        if self.index < 0:
            raise ValueError(
                f"group rank {dist.get_rank(group)} is a server (ranks 0..{plan.num_servers - 1})"
            )
        self.named = dict(model.named_parameters())
        self.device = torch.device("cpu")  # the wire (gloo) carries CPU tensors
        self.clock = 0
        self.versions = [0] * plan.num_servers
        self.history = WorkerHistory()
        self.stopped = False
        self._outstanding = 0
        """Replies owed by the servers: each push also asks for the next parameters."""
        self._lock = threading.Lock()
        self._quiet = threading.Event()
        self._heartbeat = heartbeat
        self._beats: threading.Thread | None = None
        if heartbeat > 0:
            self._beats = threading.Thread(target=self._beat, daemon=True, name="phalanx-ps-beat")
            self._beats.start()

    def pull(self) -> bool:
        """Load the parameters for step ``clock`` into the model; False when told to stop.

        Raises:
            ServerError: when a server refused this worker's last update, or stopped the job.
        """
        if self.stopped:
            return False
        if not self._outstanding:
            for s in range(self.plan.num_servers):
                self._send(s, Kind.PULL_REQUEST, step=self.clock)
            self._outstanding = 1
        replies = self._replies()
        if any(m.header.kind is Kind.STOP for m in replies):
            self.stopped = True
            return False
        for s, msg in enumerate(replies):
            self._load(s, msg)
        self.history.pulls.append((self.clock, min(self.versions)))
        return True

    def push(self) -> None:
        """Send the model's gradients (zeros where a parameter has none) for step ``clock``.

        The push also asks for the parameters of the next step (one message less per step);
        :meth:`pull` receives them.
        """
        grads = {
            n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.named.items()
        }
        for s in range(self.plan.num_servers):
            flat = self.plan.flatten(grads, s).detach().cpu()
            self._send(s, Kind.PUSH, step=self.clock, payload=flat, flags=FLAG_PULL)
        self._outstanding += 1
        self.clock += 1

    def close(self, final: bool = True) -> None:
        """Tell every server this worker is done; with ``final``, load the final parameters.

        The final parameters arrive once every worker has finished (or was lost).
        """
        self._stop_heartbeats()
        if self._outstanding and not self.stopped:
            self._replies()  # the answer to the last push's request, superseded by STOP
        flags = FLAG_FINAL if final else 0
        for s in range(self.plan.num_servers):
            self._send(s, Kind.STOP, step=self.clock, flags=flags)
        if final:  # they come once the last worker finished: when is the others' business
            for s in range(self.plan.num_servers):
                self._load(s, self._receive(s, idle=True))
        self.stopped = True

    # ---- internals ---------------------------------------------------------------------------
    def _send(
        self,
        server: int,
        kind: Kind,
        *,
        step: int,
        payload: torch.Tensor | None = None,
        flags: int = 0,
    ) -> None:
        header = encode_header(
            kind,
            worker=self.index,
            step=step,
            version=self.versions[server],
            shard=server,
            numel=0 if payload is None else payload.numel(),
            dtype=None if payload is None else payload.dtype,
            flags=flags,
        )
        with self._lock:
            wire.send(header, server, self.group, payload)

    def _replies(self) -> list[wire.Message]:
        """Every outstanding reply of every server; the last one of each counts."""
        owed, self._outstanding = self._outstanding, 0
        last = []
        for s in range(self.plan.num_servers):
            for _ in range(owed - 1):
                self._receive(s)
            last.append(self._receive(s))
        return last

    def _receive(self, server: int, idle: bool = False) -> wire.Message:
        msg = wire.receive(server, self.group, self.plan, self.device, idle=idle)
        if msg.header.kind is Kind.ERROR:
            text = msg.text
            self._stop_heartbeats()
            raise (WorkerLost if msg.header.flags & FLAG_FATAL else ServerError)(text)
        return msg

    def _load(self, server: int, msg: wire.Message) -> None:
        if msg.header.kind is not Kind.PARAMS or msg.payload is None:
            raise ServerError(
                f"worker {self.index}: server {server} sent {msg.header.kind.name}, expected PARAMS"
            )
        self.versions[server] = msg.header.version
        views = self.plan.unflatten(msg.payload, server)
        with torch.no_grad():
            for name, view in views.items():
                p = self.named[name]
                p.copy_(view.view_as(p))

    def _beat(self) -> None:
        while not self._quiet.wait(self._heartbeat):
            for s in range(self.plan.num_servers):
                try:
                    self._send(s, Kind.HEARTBEAT, step=self.clock)
                except Exception:  # the server is gone; the main thread will find out
                    return

    def _stop_heartbeats(self) -> None:
        self._quiet.set()
        if self._beats is not None and self._beats is not threading.current_thread():
            self._beats.join()
