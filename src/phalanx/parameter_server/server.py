"""A parameter-server shard: receives pushes and pulls over c10d P2P and runs its optimizer.

One receiver thread per worker blocks in ``recv`` from that worker and queues what arrives;
the main thread alone touches the state (the :class:`.core.ServerCore` rules, the optimizer,
the replies). A worker is declared lost when its connection fails, when it sends a header that
does not decode, or when nothing, not even a heartbeat, arrived for ``dead_after`` seconds.
Replies go out as non-blocking sends of a snapshot, so a worker that is busy computing never
stalls the server, and the optimizer may update the shard while a reply is in flight.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.parameter_server import wire
from phalanx.parameter_server.core import ServerCore, WorkerLost
from phalanx.parameter_server.protocol import Kind, ProtocolError, encode_header
from phalanx.parameter_server.shards import ShardPlan
from phalanx.parameter_server.validate import MalformedUpdate, check_update

__all__ = ["FLAG_FATAL", "FLAG_FINAL", "FLAG_PULL", "Server", "ServerReport"]

log = logging.getLogger(__name__)

FLAG_FINAL = 1
"""STOP flag: the worker wants the final parameters once every worker has finished."""
FLAG_FATAL = 2
"""ERROR flag: the server stopped the job (a synchronous server lost a worker)."""
FLAG_PULL = 4
"""PUSH flag: the worker also asks for the parameters of its next step."""

MakeOptimizer = Callable[[dict[str, nn.Parameter]], torch.optim.Optimizer]
OnVersion = Callable[[int, torch.Tensor], None]


@dataclass
class ServerReport:
    """What one server shard did, returned by :meth:`Server.serve`."""

    shard: int
    mode: str
    version: int
    """Optimizer steps applied."""
    applied: int
    """Gradients applied."""
    duplicates: int
    """Pushes ignored because their ``(worker, step)`` was applied before."""
    staleness: dict[int, int]
    """Staleness -> number of applied gradients."""
    rejected: list[str] = field(default_factory=list)
    """Why each malformed update was refused."""
    lost: dict[int, str] = field(default_factory=dict)
    """Worker -> why it was declared lost."""
    seconds: float = 0.0


class Server:
    """Serve one shard of the parameters until every worker has stopped or been lost.

    Args:
        params: The model's parameters by name (the initial values; this shard's are copied).
        make_optimizer: Builds the optimizer over this shard's parameters (name -> parameter).
        plan: The shard plan every rank built from the same model.
        shard: This server's shard index (its group rank).
        group: Servers are group ranks ``0 .. S-1``, workers ``S ..``.
        mode, bound, staleness_lr, max_updates: The consistency rules, see
            :class:`~phalanx.parameter_server.core.ServerCore`.
        heartbeat: Seconds between worker heartbeats.
        dead_after: Seconds of silence after which a worker is lost.
        on_version: Called as ``on_version(version, flat_shard)`` after each optimizer step.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        make_optimizer: MakeOptimizer,
        plan: ShardPlan,
        shard: int,
        group: dist.ProcessGroup,
        *,
        mode: str,
        bound: int | None = None,
        staleness_lr: bool = False,
        max_updates: int | None = None,
        heartbeat: float = 0.5,
        dead_after: float = 3.0,
        on_version: OnVersion | None = None,
    ) -> None:
        self.plan, self.shard, self.group = plan, shard, group
        self.heartbeat, self.dead_after, self.on_version = heartbeat, dead_after, on_version
        self.device = torch.device("cpu")  # the wire (gloo) carries CPU tensors
        self.flat = plan.flatten({k: v.detach().cpu() for k, v in params.items()}, shard).clone()
        shapes = {s.name: tuple(params[s.name].shape) for s in plan.slots(shard)}
        self.shapes = shapes
        self.params = {
            n: nn.Parameter(v) for n, v in plan.unflatten(self.flat, shard, shapes).items()
        }
        self.optimizer = make_optimizer(self.params)
        self.num_workers = dist.get_world_size(group) - plan.num_servers
        self.core = ServerCore(
            self.num_workers,
            mode,
            self.apply,
            bound=bound,
            staleness_lr=staleness_lr,
            max_updates=max_updates,
        )
        self._inbox: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self._last_seen: dict[int, float] = {}
        self._outgoing: dict[int, wire.Sent] = {}
        self._errors: dict[int, str] = {}
        self._final: set[int] = set()
        self.report = ServerReport(shard, mode, 0, 0, 0, {})

    # ---- the optimizer step ------------------------------------------------------------------
    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """One optimizer step of this shard with flat gradient ``grad`` (lr times ``lr_scale``)."""
        views = self.plan.unflatten(grad.to(self.flat.dtype), self.shard, self.shapes)
        for name, p in self.params.items():
            p.grad = views[name]
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if lr_scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * lr_scale
        try:
            with torch.no_grad():
                self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_version is not None:
            self.on_version(self.core.version + 1, self.flat)

    # ---- the loop ----------------------------------------------------------------------------
    def serve(self) -> ServerReport:
        """Run until every worker stopped or was lost; returns the :class:`ServerReport`.

        Raises:
            WorkerLost: in ``sync`` mode, when a worker is lost (naming it); the other
                workers receive the same message as an error.
        """
        start = time.monotonic()
        for w in range(self.num_workers):
            self._last_seen[w] = start
            threading.Thread(
                target=self._receive_loop, args=(w,), daemon=True, name=f"phalanx-ps-recv-{w}"
            ).start()
        while self.core.live:
            try:
                worker, what, item = self._inbox.get(timeout=self.heartbeat / 2)
            except queue.Empty:
                pass
            else:
                self._handle(worker, what, item)
            self._check_heartbeats()
        self._finish()
        self.report.seconds = time.monotonic() - start
        return self.report

    def load_into(self, model: nn.Module) -> None:
        """Copy this shard's current parameters into ``model`` (the same architecture)."""
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in self.params.items():
                named[name].copy_(p)

    # ---- receiving ---------------------------------------------------------------------------
    def _receive_loop(self, worker: int) -> None:
        src = self.plan.num_servers + worker
        while True:
            try:
                msg = wire.receive(src, self.group, self.plan, self.device, idle=True)
            except wire.Unauthenticated as exc:
                self._inbox.put((worker, "lost", f"failed authentication: {exc}"))
                return
            except ProtocolError as exc:
                self._inbox.put((worker, "lost", f"sent a malformed header: {exc}"))
                return
            except Exception as exc:  # the backend's error when the peer is gone
                self._inbox.put((worker, "lost", f"connection failed: {exc}"))
                return
            self._last_seen[worker] = time.monotonic()
            if msg.header.kind is Kind.HEARTBEAT:
                continue
            self._inbox.put((worker, "msg", msg))
            if msg.header.kind is Kind.STOP:
                return

    def _handle(self, worker: int, what: str, item: Any) -> None:
        if what == "lost":
            self._lose(worker, item)
            return
        msg: wire.Message = item
        h = msg.header
        if h.worker != worker:
            self._lose(worker, f"sent a header claiming to be worker {h.worker}")
        elif h.kind is Kind.PUSH:
            self._push(worker, msg)
            if h.flags & FLAG_PULL:
                self._pull(worker, h.step + 1)
        elif h.kind is Kind.PULL_REQUEST:
            self._pull(worker, h.step)
        elif h.kind is Kind.STOP:
            if h.flags & FLAG_FINAL:
                self._final.add(worker)
            self._reply(self.core.leave(worker))
        else:
            self._lose(worker, f"sent a {h.kind.name} message, which workers do not send")

    def _pull(self, worker: int, clock: int) -> None:
        if worker in self._errors:
            self._send(worker, Kind.ERROR, 0, wire.error_payload(self._errors.pop(worker)))
        else:
            self._reply(self.core.pull(worker, clock))

    def _push(self, worker: int, msg: wire.Message) -> None:
        h = msg.header
        assert msg.payload is not None
        try:
            if h.shard != self.shard:
                raise MalformedUpdate(
                    f"refused update from worker {worker} for shard {h.shard} (step {h.step}): "
                    f"sent to server {self.shard}"
                )
            check_update(h, msg.payload, self.plan, dtype=self.flat.dtype)
            accepted = self.core.push(worker, h.step, h.version, msg.payload)
        except (MalformedUpdate, ValueError) as exc:
            log.warning("parameter server %d: %s", self.shard, exc)
            self.report.rejected.append(str(exc))
            self._errors[worker] = str(exc)
            return
        if accepted:
            self._reply(self.core.answers())

    # ---- sending -----------------------------------------------------------------------------
    def _reply(self, replies: list[Any]) -> None:
        for r in replies:
            if r.stop:
                self._send(r.worker, Kind.STOP, r.version)
            else:
                self._send(r.worker, Kind.PARAMS, r.version, self.flat.detach().clone())

    def _send(
        self, worker: int, kind: Kind, version: int, payload: Any = None, flags: int = 0
    ) -> None:
        self._settle(worker)
        header = encode_header(
            kind,
            worker=worker,
            version=version,
            shard=self.shard,
            numel=0 if payload is None else payload.numel(),
            dtype=None if payload is None else payload.dtype,
            flags=flags,
        )
        dst = self.plan.num_servers + worker
        try:
            sent = wire.send(header, dst, self.group, payload, wait=False)
        except Exception as exc:
            self._lose(worker, f"a reply could not be sent: {exc}")
            return
        self._outgoing[worker] = sent  # its tensors live until the sends complete

    def _settle(self, worker: int, timeout: float | None = None) -> None:
        # Called when the worker asked again, so it received the previous reply: the wait
        # returns at once. A worker that is gone fails it; it is (or will be) declared lost.
        sent = self._outgoing.pop(worker, None)
        if sent is not None:
            with contextlib.suppress(Exception):
                sent.wait(timeout)

    # ---- losing workers, finishing ----------------------------------------------------------
    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for w in sorted(self.core.live):
            silent = now - self._last_seen[w]
            if silent > self.dead_after:
                self._lose(
                    w, f"sent nothing for {silent:.1f} s (heartbeat every {self.heartbeat} s)"
                )

    def _lose(self, worker: int, why: str) -> None:
        if worker not in self.core.live:
            return
        rank = self.plan.num_servers + worker
        self.report.lost[worker] = why
        log.warning(
            "parameter server %d: worker %d (rank %d) lost: %s", self.shard, worker, rank, why
        )
        if self.core.mode == "sync":
            self._fail(
                f"parameter server {self.shard}: worker {worker} (group rank {rank}) {why}; "
                f"mode='sync' needs every worker each step, so the job stops (mode='async' "
                f"or 'ssp' carries on without lost workers)"
            )
        self._reply(self.core.leave(worker))

    def _fail(self, text: str) -> None:
        others = sorted(self.core.live - set(self.report.lost))
        for w in others:
            self._send(w, Kind.ERROR, self.core.version, wire.error_payload(text), FLAG_FATAL)
        deadline = time.monotonic() + min(self.dead_after, 5.0)
        for w in others:  # give waiting workers the reason before this rank raises
            self._settle(w, timeout=max(0.1, deadline - time.monotonic()))
        raise WorkerLost(text)

    def _finish(self) -> None:
        self.core.flush()
        for w in sorted(self._final):
            self._send(w, Kind.PARAMS, self.core.version, self.flat.detach().clone())
        for w in list(self._outgoing):
            if w not in self.report.lost:  # a hung worker would hold this rank until timeout
                self._settle(w)
        core = self.core
        self.report.version, self.report.applied = core.version, core.applied
        self.report.duplicates, self.report.staleness = core.duplicates, core.ledger.histogram()
