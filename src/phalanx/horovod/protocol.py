"""The negotiation protocol: one fixed-width row per rank per round, and what a round decides.

Horovod matches operations across ranks **by name** (unnamed ones get ``noname.<k>``, k counting
this rank's unnamed calls), checks their shapes and dtypes, and lets ranks that called ``join()``
take part with neutral values. phalanx does the same with one small all-gather per round: every
rank of the process set contributes a row saying what it is doing (a new request, waiting for a
deferred one, or joined), which requests it has deferred, and a signature of the request. Every
rank then runs the same pure :func:`decide` over the same rows, so every rank reaches the same
decision (run these requests, in this order; defer that one; report this error) without another
message. Pure functions only; the controller (``controller.py``) does the communication.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PAYLOAD_SLOTS",
    "PENDING_SLOTS",
    "ROW",
    "Kind",
    "Plan",
    "ReduceOp",
    "Row",
    "State",
    "decide",
    "decode_rows",
    "encode_row",
    "stable_hash",
]

PENDING_SLOTS = 8
"""Deferred requests a row names; a rank with more makes the round exchange full lists."""
PAYLOAD_SLOTS = 16
"""Per-request integers a row carries (allgather's first dimensions, alltoall's splits)."""
_HEADER = 7
ROW = _HEADER + PENDING_SLOTS + PAYLOAD_SLOTS
"""Width of a row in int64 elements (288 bytes)."""


class Kind(enum.IntEnum):
    """The operation a request performs (its name in messages is the lower-case member name)."""

    ALLREDUCE = 1
    GROUPED_ALLREDUCE = 2
    ALLGATHER = 3
    GROUPED_ALLGATHER = 4
    BROADCAST = 5
    ALLTOALL = 6
    REDUCESCATTER = 7
    GROUPED_REDUCESCATTER = 8
    BARRIER = 9
    BROADCAST_OBJECT = 10
    ALLGATHER_OBJECT = 11
    BROADCAST_PARAMETERS = 12
    OPTIMIZER = 13
    """A DistributedOptimizer's bucketed gradient all-reduces of one backward pass."""

    @property
    def label(self) -> str:
        """The user-facing name, e.g. ``grouped_allreduce``."""
        return self.name.lower()


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations (exported as ``hvd.Average``, ``hvd.Sum``, ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


class State(enum.IntEnum):
    """What a rank is doing in a round."""

    ASYNC = 1
    """Issuing a request that may be deferred (an ``*_async`` call)."""
    BLOCKING = 2
    """Issuing a request and waiting for it (a synchronous call)."""
    WAIT = 3
    """Waiting in ``synchronize()`` for a request it deferred earlier."""
    JOINED = 4
    """In ``join()``: takes part in the others' requests with neutral values."""


@dataclass(frozen=True)
class Row:
    """One rank's contribution to a round."""

    state: State
    kind: int
    """Kind of the current request (0 when joined)."""
    name: int
    """Hash of the current request's key (or of the awaited one when waiting)."""
    sig: int
    """Hash of everything about the current request that must agree across ranks."""
    join_rounds: int
    """Rounds completed since this rank called join() (the last to join has the fewest)."""
    pending: tuple[int, ...]
    """Hashes of this rank's deferred requests, in the order it issued them."""
    n_pending: int
    """All deferred requests; more than ``len(pending)`` means the list was cut."""
    payload: tuple[int, ...] | None
    """The current request's integers; None if they did not fit."""


def stable_hash(text: str) -> int:
    """A 63-bit hash of ``text``, the same in every process (Python's ``hash`` is salted)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] & 0x7FFF_FFFF_FFFF_FFFF


def encode_row(row: Row) -> list[int]:
    """The row as ``ROW`` integers (the tensor that is all-gathered)."""
    pending = list(row.pending[:PENDING_SLOTS])
    payload = list(row.payload or ())
    fits = row.payload is not None and len(payload) <= PAYLOAD_SLOTS
    head = [
        int(row.state),
        row.kind,
        row.name,
        row.sig,
        row.join_rounds,
        row.n_pending,
        len(payload) if fits else -1,
    ]
    pending += [0] * (PENDING_SLOTS - len(pending))
    payload = (payload if fits else []) + [0] * (PAYLOAD_SLOTS - (len(payload) if fits else 0))
    return head + pending + payload


def decode_rows(values: Sequence[Sequence[int]]) -> list[Row]:
    """Inverse of :func:`encode_row` for every rank's row."""
    rows = []
    for v in values:
        n_pending, n_payload = v[5], v[6]
        pending = tuple(v[_HEADER : _HEADER + min(n_pending, PENDING_SLOTS)])
        start = _HEADER + PENDING_SLOTS
        payload = None if n_payload < 0 else tuple(v[start : start + n_payload])
        rows.append(Row(State(v[0]), v[1], v[2], v[3], v[4], pending, n_pending, payload))
    return rows


@dataclass(frozen=True)
class Plan:
    """What every rank does after a round (the same on every rank)."""

    ready: tuple[int, ...] = ()
    """Requests (by name hash) that every active rank has: run them now, in this order."""
    fast: int | None = None
    """The ready request that is every rank's current one, so the rows alone check it."""
    deferred: frozenset[int] = frozenset()
    """Rows whose asynchronous request is not ready: it waits, and that rank returns."""
    finished: bool = False
    """Every rank has joined: join() returns."""
    last_joined: int = -1
    """Row of the rank that joined last (when finished)."""
    stuck: bool = False
    """No rank can make progress: every active rank waits for something another lacks."""


def _available(row: Row) -> set[int]:
    own = set(row.pending)
    if row.state in (State.ASYNC, State.BLOCKING):
        own.add(row.name)
    return own


def decide(rows: Sequence[Row], pending: Sequence[Sequence[int]] | None = None) -> Plan:
    """The decision of a round, from every rank's row.

    Args:
        rows: One row per rank of the process set, in process-set rank order.
        pending: Every rank's full list of deferred requests, when a row's list was cut.

    Returns:
        The :class:`Plan` every rank follows.
    """
    if pending is not None:
        rows = [_with_pending(r, p) for r, p in zip(rows, pending)]
    active = [i for i, r in enumerate(rows) if r.state != State.JOINED]
    if not active:
        fewest = min(r.join_rounds for r in rows)
        last = max(i for i, r in enumerate(rows) if r.join_rounds == fewest)
        return Plan(finished=True, last_joined=last)
    ready_set = set.intersection(*(_available(rows[i]) for i in active))
    first = rows[active[0]]
    order = [*first.pending, *([first.name] if first.state != State.WAIT else [])]
    ready = tuple(dict.fromkeys(n for n in order if n in ready_set))
    waiting = [i for i in active if rows[i].state == State.ASYNC]
    deferred = frozenset(i for i in waiting if rows[i].name not in ready_set)
    fast = None
    if len(active) == len(rows) and all(
        r.state in (State.ASYNC, State.BLOCKING) and r.name == first.name for r in rows
    ):
        fast = first.name if first.name in ready_set else None
    return Plan(ready=ready, fast=fast, deferred=deferred, stuck=not ready and not deferred)


def _with_pending(row: Row, pending: Sequence[int]) -> Row:
    return Row(
        row.state,
        row.kind,
        row.name,
        row.sig,
        row.join_rounds,
        tuple(pending),
        len(pending),
        row.payload,
    )
