"""The server's consistency rules as a pure state machine: when to apply, when to answer a pull.

One :class:`ServerCore` per server shard turns events (a worker pushed a gradient, asked for
parameters, stopped, died) into decisions (apply this gradient now, answer that pull with the
current parameters, tell that worker to stop). It touches no process group, so every rule is
unit-tested without processes, and the communication loop in :mod:`.server` stays thin.

The modes (seed 003 contrasts the first two; the third is Ho et al. 2013, "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server"):

``sync``
    Each clock (step) the server waits for a gradient from every live worker, averages them in
    worker order and applies one optimizer step: the same arithmetic as data parallel with an
    all-reduce average, so it matches DDP.
``async``
    Every gradient is applied when it arrives (ASGD; Dean et al. 2012, "Large Scale Distributed
    Deep Networks"), and a pull is answered at once. The gradient's staleness, server version
    minus the version the worker computed on, is recorded; optionally the learning rate is
    scaled by ``1 / (1 + staleness)`` (Zhang et al. 2016, "Staleness-aware Async-SGD").
``ssp`` with bound ``s``
    Gradients are averaged per clock as in ``sync``, but a worker at clock ``c`` may compute on
    parameters of version ``c - s`` or newer: a fast worker runs up to ``s`` clocks ahead of the
    slowest live one and waits beyond that. Applying whole clocks keeps ``s = 0`` *identical* to
    ``sync`` for any optimizer (not only for plain SGD), and bounds every applied gradient's
    staleness by ``s``. With ``staleness_lr`` each gradient in a clock's average is weighted by
    ``1 / (1 + staleness)``.

Versions count optimizer steps. In ``sync`` / ``ssp`` the version is the number of completed
clocks; in ``async`` it is the number of applied gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from phalanx.parameter_server.ledger import Ledger

__all__ = ["MODES", "Reply", "ServerCore", "WorkerLost", "check_mode"]

MODES = ("sync", "async", "ssp")

Apply = Callable[[torch.Tensor, float], None]
"""``apply(flat_gradient, lr_scale)``: one optimizer step on the server's shard."""


class WorkerLost(RuntimeError):
    """A synchronous parameter server lost a worker it cannot continue without."""


def check_mode(mode: str, bound: int | None) -> int:
    """Validate ``mode`` / ``bound`` and return the effective staleness bound (0 for sync).

    Raises:
        ValueError: for an unknown mode, a bound outside ``ssp`` or a negative bound.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if mode == "ssp":
        if bound is None or bound < 0:
            raise ValueError(f"mode='ssp' needs a staleness bound >= 0, got bound={bound}")
        return bound
    if bound not in (None, 0):
        raise ValueError(f"bound={bound} applies to mode='ssp' only, got mode={mode!r}")
    return 0


@dataclass(frozen=True)
class Reply:
    """An answer to a waiting pull: the parameters at ``version``, or ``stop``."""

    worker: int
    version: int
    stop: bool = False


@dataclass
class _Pending:
    """Gradients of one clock received so far: worker -> (gradient, pulled version)."""

    grads: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)


class ServerCore:
    """Consistency state of one server shard; see the module docstring for the rules.

    Args:
        num_workers: Workers ``0 .. num_workers - 1``.
        mode: ``"sync"``, ``"async"`` or ``"ssp"``.
        apply: Applies one optimizer step: ``apply(flat_gradient, lr_scale)``.
        bound: Staleness bound for ``ssp``.
        staleness_lr: Scale by ``1 / (1 + staleness)`` (async: learning rate; ssp: weights).
        max_updates: Apply exactly this many gradients, then stop workers (None: never). A
            pull is granted only while the gradients accepted plus those owed by granted
            pulls stay below it.
    """

    def __init__(
        self,
        num_workers: int,
        mode: str,
        apply: Apply,
        *,
        bound: int | None = None,
        staleness_lr: bool = False,
        max_updates: int | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_updates is not None and max_updates < 1:
            raise ValueError(f"max_updates must be >= 1 or None, got {max_updates}")
        self.bound = check_mode(mode, bound)
        self.mode, self.num_workers, self._apply = mode, num_workers, apply
        self.staleness_lr, self.max_updates = staleness_lr, max_updates
        self.ledger = Ledger()
        self.version = 0
        self.accepted = 0
        """Distinct gradients accepted (applied, or waiting for their clock)."""
        self.applied = 0
        self.duplicates = 0
        self.clocks = dict.fromkeys(range(num_workers), 0)
        self.live = set(range(num_workers))
        self.waiting: dict[int, int] = {}
        """Worker -> clock of its unanswered pull."""
        self._granted: set[int] = set()
        """Workers that received parameters and owe a gradient (counted against the budget)."""
        self._pending: dict[int, _Pending] = {}

    # ---- events ------------------------------------------------------------------------------
    def push(self, worker: int, step: int, pulled_version: int, grad: torch.Tensor) -> bool:
        """A gradient for ``step`` computed on ``pulled_version``; False for a duplicate.

        Raises:
            ValueError: for an unknown worker, or a version the server never served.
        """
        self._known(worker)
        if pulled_version > self.version:
            raise ValueError(
                f"worker {worker}: pulled_version={pulled_version} is newer than the server's "
                f"version {self.version}"
            )
        if not self.ledger.accept(worker, step):
            self.duplicates += 1
            return False
        self.accepted += 1
        self._granted.discard(worker)
        self.clocks[worker] = max(self.clocks[worker], step + 1)
        if self.mode == "async":
            staleness = self.ledger.record(worker, pulled_version, self.version)
            self._step(grad, 1.0 / (1 + staleness) if self.staleness_lr else 1.0, 1)
        else:
            self._pending.setdefault(step, _Pending()).grads[worker] = (grad, pulled_version)
            self._complete_clocks()
        return True

    def pull(self, worker: int, clock: int) -> list[Reply]:
        """``worker`` asks for parameters to compute its step ``clock``; returns the answers due."""
        self._known(worker)
        self.waiting[worker] = clock
        return self.answers()

    def leave(self, worker: int) -> list[Reply]:
        """``worker`` stopped or died: it no longer holds back a clock or the bound."""
        self._known(worker)
        self.live.discard(worker)
        self.waiting.pop(worker, None)
        self._granted.discard(worker)
        self._complete_clocks()
        return self.answers()

    # ---- decisions ---------------------------------------------------------------------------
    def answers(self) -> list[Reply]:
        """Every waiting pull that may be answered now, removed from ``waiting``."""
        out = []
        for worker, clock in sorted(self.waiting.items()):
            if self.budget_spent():
                out.append(Reply(worker, self.version, stop=True))
            elif self.mode == "async" or self.version >= clock - self.bound:
                out.append(Reply(worker, self.version))
                self._granted.add(worker)
        for reply in out:
            del self.waiting[reply.worker]
        return out

    def budget_spent(self) -> bool:
        """True once the gradients accepted or owed by granted pulls reach ``max_updates``."""
        owed = self.accepted + len(self._granted)
        return self.max_updates is not None and owed >= self.max_updates

    def flush(self) -> None:
        """Apply the clocks that can no longer complete (every worker has left)."""
        if not self.live:
            for clock in sorted(self._pending):
                self._apply_clock(clock)

    # ---- internals ---------------------------------------------------------------------------
    def _known(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker={worker} is not in [0, {self.num_workers})")

    def _complete_clocks(self) -> None:
        # Clock c completes when every live worker has pushed it; clocks complete in order.
        while self.version in self._pending:
            clock = self.version
            got = self._pending[clock].grads
            if any(w not in got for w in self.live):
                return
            self._apply_clock(clock)

    def _apply_clock(self, clock: int) -> None:
        got = self._pending.pop(clock).grads
        total: torch.Tensor | None = None
        for worker in sorted(got):  # fixed order: the same sum on every run
            grad, pulled = got[worker]
            staleness = self.ledger.record(worker, pulled, self.version)
            if self.staleness_lr and staleness:
                grad = grad / (1 + staleness)
            total = grad.clone() if total is None else total.add_(grad)
        assert total is not None
        self._step(total.div_(len(got)), 1.0, len(got))

    def _step(self, grad: torch.Tensor, lr_scale: float, gradients: int) -> None:
        self._apply(grad, lr_scale)
        self.version += 1
        self.applied += gradients
