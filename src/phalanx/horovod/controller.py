"""The controller of one process set: negotiate each operation by name, then launch it.

Every operation goes through :meth:`Controller.submit`: a round all-gathers one row per rank
(``protocol.py``) on the process set's gloo negotiation group, every rank runs the same
:func:`~phalanx.horovod.protocol.decide`, and the requests that every active rank has issued are
launched, in the same order everywhere. What this buys over issuing collectives directly:

* mismatched shapes, dtypes, roots, reductions or operations raise a ``RuntimeError``
  (:class:`~phalanx.comm.errors.CollectiveMismatchError`) on **every** rank, naming each rank's
  call, where gloo aborts, hangs or returns wrong data;
* operations are matched by ``name``: an ``*_async`` call whose peers are busy elsewhere is
  deferred (its handle reports ``poll() == False``) and runs when they issue it; a second
  operation under a name still in flight raises ``ValueError``, as in Horovod;
* ranks in ``join()`` keep answering rounds and take part in the others' all-reduces with neutral
  values (zeros for a sum; Horovod refuses allgather, broadcast, alltoall and reducescatter then,
  and so does phalanx, on the ranks that called them);
* when every rank waits for something another has not issued, every rank raises instead of hanging.

The price is one all-gather of 288 bytes per rank before each operation: about 0.5 ms at two
CPU ranks (``benchmarks/horovod_negotiation.py``), more than a small all-reduce takes, little
next to a large one; and an ``*_async`` call returns once every rank of the set has reached an
operation (its collective then runs in the background).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.objects import all_gather_object
from phalanx.horovod.handle import Handle
from phalanx.horovod.protocol import ROW, Kind, Plan, Row, State, decide, decode_rows, encode_row
from phalanx.horovod.protocol import stable_hash as _hash
from phalanx.horovod.requests import Agreement, Desc, Request, describe, mismatch, signature

__all__ = ["NEUTRAL", "Controller"]

Neutral = Callable[[Desc], Request]
NEUTRAL: dict[Kind, Neutral] = {}
"""How a joined rank takes part in a request of each kind (op modules register themselves)."""

_Entry = tuple[Request, Handle]


class Controller:
    """Negotiates and launches the operations of one process set on this rank."""

    def __init__(self, ranks: list[int], meta: dist.ProcessGroup | None, label: str) -> None:
        self.ranks = ranks
        """Global ranks of the set, in set order."""
        self.meta = meta
        """gloo group the rows travel on (None for a set of one)."""
        self.label = label
        self.me = dist.get_rank()
        self._unnamed = 0
        self._pending: dict[int, _Entry] = {}  # deferred requests by name hash, in issue order
        self._in_flight: dict[str, Handle] = {}
        self.optimizers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        """The DistributedOptimizers of this set by key, for a joined rank to shadow."""
        self._optimizers_made = 0
        self._outstanding: Callable[[], None] | None = None

    # ---- entry points -------------------------------------------------------------------------
    def submit(self, req: Request, blocking: bool) -> Handle:
        """Issue ``req``; returns its handle (launched, failed, or deferred if not ``blocking``)."""
        handle = self._register(req)
        if len(self.ranks) == 1:
            self._start((req, handle), Agreement((req.payload,)))
        else:
            self._negotiate(State.BLOCKING if blocking else State.ASYNC, (req, handle))
        return handle

    def submit_overlapped(self, req: Request) -> Callable[[], None]:
        """Start the first round of a blocking request without waiting for it; the returned
        function completes it (negotiating further if needed) and raises if it failed.

        A DistributedOptimizer announces each backward pass this way, so the round travels
        while backward computes. Any other round this rank starts settles it first.
        """
        handle = self._register(req)
        if len(self.ranks) == 1:
            self._start((req, handle), Agreement((req.payload,)))
            return handle.wait
        everyone, mine = self._buffers(self._row(State.BLOCKING, (req, handle), 0))
        work = c.all_gather_into_tensor(everyone, mine, group=self.meta, async_op=True)

        def finish() -> None:
            if self._outstanding is finish:
                self._outstanding = None
                work.wait()
                self._negotiate(State.BLOCKING, (req, handle), self._decode(everyone))
            handle.wait()

        self._outstanding = finish
        return finish

    def _register(self, req: Request) -> Handle:
        self._settle()
        req.key = self._key(req)
        req.key_hash = _hash(req.key)
        if req.key in self._in_flight:
            raise ValueError(
                f"[rank {self.me}] {req.kind.label}: an operation named {req.name!r} is already "
                f"in flight on this rank (issued, not yet synchronized); give this one another "
                f"name=, or synchronize() the first before reusing its name"
            )
        if req.name is None:
            self._unnamed += 1
        handle = Handle()
        key = req.key
        self._in_flight[key] = handle
        handle.on_release(lambda: self._in_flight.pop(key, None))
        return handle

    def join(self) -> int:
        """Answer the others' rounds with neutral values until every rank has joined."""
        if len(self.ranks) == 1:
            return self.me
        self._settle()
        plan = self._negotiate(State.JOINED, None)
        return self.ranks[plan.last_joined]

    def add_optimizer(self, sync: Any) -> str:
        """Register a DistributedOptimizer's gradient sync; its key, the same on every rank."""
        key = str(self._optimizers_made)
        self._optimizers_made += 1
        self.optimizers[key] = sync
        return key

    def discard(self) -> None:
        """Forget deferred and unsynchronized operations (shutdown)."""
        self._outstanding = None
        self._pending.clear()
        self._in_flight.clear()

    # ---- rounds -------------------------------------------------------------------------------
    def _key(self, req: Request) -> str:
        name = req.name if req.name is not None else f"noname.{self._unnamed}"
        return f"{req.kind.label}.{name}"

    def _resolve(self, handle: Handle) -> None:
        entry = next((e for e in self._pending.values() if e[1] is handle), None)
        if entry is not None:
            self._negotiate(State.WAIT, entry)

    def _settle(self) -> None:
        """Complete an overlapped round first: every rank's rounds stay in one order."""
        if self._outstanding is not None:
            self._outstanding()

    def _negotiate(
        self, state: State, current: _Entry | None, first: list[Row] | None = None
    ) -> Plan:
        rounds = 0
        while True:
            rows = first if first is not None else self._exchange(self._row(state, current, rounds))
            first = None
            cut = any(r.n_pending > len(r.pending) for r in rows)
            plan = decide(rows, self._gather(list(self._pending)) if cut else None)
            self._run(plan, rows, current)
            rounds += 1
            if plan.stuck:  # every rank (joined ones too) takes part in explaining why
                error = self._stuck_error(rows, state, current)
                if current is not None:
                    self._pending.pop(current[0].key_hash, None)
                    current[1].fail(error)
                    return plan
            if current is None:
                if plan.finished:
                    return plan
                continue
            req, handle = current
            if self.ranks.index(self.me) in plan.deferred:
                self._pending[req.key_hash] = current
                handle.defer(self._resolve)
                return plan
            if not handle.deferred and req.key_hash in plan.ready:
                return plan

    def _row(self, state: State, current: _Entry | None, rounds: int) -> Row:
        pending = tuple(self._pending)
        if current is None:
            return Row(state, 0, 0, 0, rounds, pending, len(pending), ())
        req = current[0]
        sig = signature(describe(req))
        return Row(state, int(req.kind), req.key_hash, sig, 0, pending, len(pending), req.payload)

    def _buffers(self, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        mine = torch.tensor(encode_row(row), dtype=torch.int64)
        return torch.empty(len(self.ranks) * ROW, dtype=torch.int64), mine

    def _decode(self, everyone: torch.Tensor) -> list[Row]:
        return decode_rows(everyone.view(len(self.ranks), ROW).tolist())

    def _exchange(self, row: Row) -> list[Row]:
        everyone, mine = self._buffers(row)
        c.all_gather_into_tensor(everyone, mine, group=self.meta)
        return self._decode(everyone)

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        all_gather_object(out, obj, group=self.meta)
        return out

    # ---- running what a round decided ---------------------------------------------------------
    def _run(self, plan: Plan, rows: list[Row], current: _Entry | None) -> None:
        for name in plan.ready:
            mine = self._pending.pop(name, None)
            if mine is None and current is not None and current[0].key_hash == name:
                mine = current
            if (
                name == plan.fast
                and len({(r.kind, r.sig) for r in rows}) == 1
                and all(r.payload is not None for r in rows)
            ):
                assert mine is not None
                self._start(mine, Agreement(tuple(r.payload for r in rows)))
            else:
                self._run_checked(mine, rows)

    def _run_checked(self, mine: _Entry | None, rows: list[Row]) -> None:
        """The slow path: descriptions travel, are compared, and joined ranks learn shapes."""
        descs: list[Desc | None] = self._gather(describe(mine[0]) if mine else None)
        holders = {self.ranks[i]: d for i, d in enumerate(descs) if d is not None}
        joined = tuple(
            i for i, (r, d) in enumerate(zip(rows, descs)) if r.state == State.JOINED and d is None
        )
        first = next(iter(holders.values()))
        kind = Kind(first["kind"])
        why = mismatch(holders)
        if why is None and joined and kind not in NEUTRAL:
            names = [self.ranks[i] for i in joined]
            why = (
                f"not supported while rank(s) {names} are in join() (as in Horovod, only "
                f"all-reduces are); issue it before join() on every rank"
            )
        agreement = Agreement(tuple(tuple(d["payload"]) if d else None for d in descs), joined)
        if mine is not None:
            if why is None:
                self._start(mine, agreement)
            else:
                mine[1].fail(self._mismatch_error(kind, first["key"], why))
        else:  # a joined rank: take part with neutral values, then move on
            self._follow(first["key"])
            if why is None:
                entry = (NEUTRAL[kind](first), Handle())
                self._start(entry, agreement)
                entry[1].wait()

    def _follow(self, key: str) -> None:
        """A joined rank counts the others' unnamed operations, so later names still match."""
        name = key.split(".", 1)[1]
        if name.startswith("noname."):
            self._unnamed = max(self._unnamed, int(name.removeprefix("noname.")) + 1)

    def _start(self, entry: _Entry, agreement: Agreement) -> None:
        req, handle = entry
        works, finish = req.start(req, agreement)
        handle.launch(works, finish)

    # ---- errors every rank raises alike -------------------------------------------------------
    def _mismatch_error(self, kind: Kind, key: str, why: str) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"[rank {self.me}] {_what(kind, key)} on {self.label}: {why}. Every rank "
            f"must issue each operation with the same dtype, shape, root, op and scaling "
            f"(ranks match operations by name=, unnamed ones by call order)"
        )

    def _stuck_error(
        self, rows: list[Row], state: State, current: _Entry | None
    ) -> CollectiveMismatchError:
        if current is None:
            mine = "is in join()"
        else:
            verb = "waits for" if state == State.WAIT else "is in"
            mine = f"{verb} {_what(current[0].kind, current[0].key)}"
        doing = self._gather(mine)
        parts = [f"rank {self.ranks[i]} {d}" for i, d in enumerate(doing)]
        return CollectiveMismatchError(
            f"[rank {self.me}] no operation can run on {self.label}: {', '.join(parts)}. The "
            f"ranks issued different operations, or the same under different names, or an "
            f"operation one rank never issues; every rank must issue the same operations "
            f"(matched by name=, unnamed ones by call order)"
        )


def _what(kind: Kind, key: str) -> str:
    """An operation as messages name it: ``allreduce 'loss'``, ``allgather #3 (unnamed)``."""
    name = key.split(".", 1)[1]
    if kind == Kind.OPTIMIZER:
        return f"a backward pass of DistributedOptimizer #{name}"
    if name.startswith("noname."):
        return f"{kind.label} #{name.removeprefix('noname.')} (unnamed)"
    return f"{kind.label} {name!r}"
