"""Ring reduce-scatter and all-gather over point-to-point sends (Patarasuk & Yuan, 2009).

The flat buffer is cut into ``world`` chunks (``torch.tensor_split``'s layout, so any size
works). In the reduce-scatter phase each rank sends one chunk to its right neighbour and folds
the chunk arriving from its left neighbour into its own, ``world - 1`` times; afterwards group
rank ``r`` holds the fully reduced chunk ``r``. The all-gather phase passes the finished chunks
around the ring ``world - 1`` more times. Every rank sends and receives ``2 (world - 1) / world``
of the buffer: the bandwidth-optimal all-reduce popularised for deep learning by Baidu.

Two things make it fast over gloo. Every transfer is cut into pieces of about
:data:`PIECE_BYTES`, and a piece moves on as soon as it is ready (what a rank finishes at one
step is what it sends at the next), so the reduction of piece ``k`` overlaps the transfer of
piece ``k + 1`` and consecutive steps overlap. And receives are posted ahead, in the order the
left neighbour sends (an :class:`Inbox`): gloo moves a message only once its receive is posted,
so a pre-posted receive saves a round trip. This relies on gloo matching one peer's messages
of one tag in order; the NCCL backend would need batched P2P (``batch_isend_irecv``) instead,
as it runs individual sends and receives in stream order.

Ranks here are group-local. The schedule and chunk layout are pure functions
(:func:`ring_schedule`, :func:`chunk_spans`, :func:`piece_spans`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEPTH",
    "PIECE_BYTES",
    "TAG",
    "Inbox",
    "RingStep",
    "all_gather",
    "all_reduce",
    "chunk_spans",
    "piece_spans",
    "reduce_scatter",
    "ring_schedule",
]

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
"""``combine(a, b, out)`` writes ``a op b`` into ``out`` (elementwise; ``out`` may alias)."""
Group = dist.ProcessGroup | None
Span = tuple[int, int]

PIECE_BYTES = 4 << 20
"""Upper bound on one pipelined transfer (bytes). Measured with gloo, 2 ranks on 2 cores, on
a 64 MiB all-reduce: a single piece per chunk 85 ms, 256 KiB pieces 78 ms, 1 MiB 47-50 ms,
4 MiB 40-47 ms (native 45-53 ms); every message costs ~0.1 ms of gloo and thread wake-ups."""
DEPTH = 2
"""Scratch receives an :class:`Inbox` keeps posted ahead of the one being reduced."""
TAG = 0x7068616C
"""P2P tag of every message here ("phal"): gloo matches by tag, so the user's own sends and
receives in flight on tag 0 (or any-source receives) never pair with ours."""

REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: send chunk ``send`` right, receive chunk ``recv`` from the left."""

    phase: str
    """``"reduce_scatter"`` (fold the received chunk in) or ``"all_gather"`` (copy it)."""
    send: int
    """Index of the chunk sent to group rank ``(rank + 1) % world``."""
    recv: int
    """Index of the chunk received from group rank ``(rank - 1) % world``."""


def ring_schedule(world: int, rank: int) -> list[RingStep]:
    """The ``2 (world - 1)`` steps of a ring all-reduce for group rank ``rank``.

    The reduce-scatter phase is shifted so that rank ``r`` finishes owning chunk ``r`` (the
    layout of ``reduce_scatter_tensor``); the all-gather phase starts from there. What a rank
    sends at a reduce-scatter step is what it reduced at the step before.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    steps = range(world - 1)
    rs = [RingStep(REDUCE_SCATTER, (rank - s - 1) % world, (rank - s - 2) % world) for s in steps]
    ag = [RingStep(ALL_GATHER, (rank - s) % world, (rank - s - 1) % world) for s in steps]
    return rs + ag


def chunk_spans(numel: int, parts: int) -> list[Span]:
    """``(start, stop)`` of ``torch.tensor_split(t, parts)`` for a tensor of ``numel`` elements."""
    if parts < 1 or numel < 0:
        raise ValueError(f"need parts >= 1 and numel >= 0, got parts={parts}, numel={numel}")
    base, extra = divmod(numel, parts)
    bounds = [i * base + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def piece_spans(numel: int, max_elems: int) -> list[Span]:
    """Split ``numel`` elements into the fewest balanced pieces of at most ``max_elems``."""
    if max_elems < 1:
        raise ValueError(f"max_elems must be >= 1, got {max_elems}")
    return chunk_spans(numel, -(-numel // max_elems)) if numel else []


def piece_elems(t: torch.Tensor) -> int:
    """Elements per pipelined piece for ``t``'s dtype."""
    return max(1, PIECE_BYTES // t.element_size())


def process_group(group: Group) -> dist.ProcessGroup:
    """``group``, or the default group for None."""
    pg = dist.group.WORLD if group is None else group
    assert pg is not None, "no default process group"
    return pg


def _wire(t: torch.Tensor) -> list[torch.Tensor]:
    return [torch.view_as_real(t) if t.is_complex() else t]


def isend(t: torch.Tensor, peer: int, group: Group) -> Any:
    """Start sending ``t`` to group rank ``peer`` (the process group's own call: less overhead)."""
    return process_group(group).send(_wire(t), peer, TAG)


def irecv(t: torch.Tensor, peer: int, group: Group) -> Any:
    """Start receiving into ``t`` from group rank ``peer``."""
    return process_group(group).recv(_wire(t), peer, TAG)


def wait_all(works: Sequence[Any]) -> None:
    """Wait for each work once (a gloo work must not be waited twice)."""
    for w in works:
        w.wait()


class Inbox:
    """Everything one peer will send, received in order with receives posted ahead.

    Each item is either a tensor (received straight into it; posted as early as order allows)
    or a count of elements (received into one of :data:`DEPTH` scratch slots, posted when a
    slot frees up). :meth:`take` returns the next item once it has arrived; a scratch item
    stays valid until the following :meth:`take`.
    """

    def __init__(
        self, like: torch.Tensor, items: Sequence[torch.Tensor | int], peer: int, group: Group
    ) -> None:
        self._items = [i for i in items if (i if isinstance(i, int) else i.numel())]
        width = max((i for i in self._items if isinstance(i, int)), default=0)
        self._slots = like.new_empty(DEPTH * width).view(DEPTH, width)
        self._peer, self._group = peer, group
        self._posted: deque[tuple[Any, torch.Tensor, bool]] = deque()
        self._next = self._scratch_posted = self._scratch_busy = 0
        self._last_was_scratch = False
        self._post_ahead()

    def _post_ahead(self) -> None:
        while self._next < len(self._items):
            item = self._items[self._next]
            if isinstance(item, int):
                if self._scratch_busy == DEPTH:
                    return
                buf = self._slots[self._scratch_posted % DEPTH, :item]
                self._scratch_posted += 1
                self._scratch_busy += 1
            else:
                buf = item
            work = irecv(buf, self._peer, self._group)
            self._posted.append((work, buf, isinstance(item, int)))
            self._next += 1

    def take(self) -> torch.Tensor:
        """Wait for the next item and return the tensor it landed in."""
        if self._last_was_scratch:  # the caller is done with the previous scratch slot
            self._scratch_busy -= 1
            self._post_ahead()
        work, buf, self._last_was_scratch = self._posted.popleft()
        work.wait()
        return buf


def _neighbours(group: Group) -> tuple[int, int, int, int]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, world, (rank + 1) % world, (rank - 1) % world


def _chunk_pieces(flat: torch.Tensor, world: int) -> list[list[torch.Tensor]]:
    """``pieces[c]``: chunk ``c`` of ``flat`` cut into pipelined pieces (none if it is empty)."""
    size = piece_elems(flat)
    chunks = [flat[a:b] for a, b in chunk_spans(flat.numel(), world)]
    return [[c[a:b] for a, b in piece_spans(c.numel(), size)] for c in chunks]


def _pass_around(
    pieces: list[list[torch.Tensor]],
    steps: list[RingStep],
    inbox: Inbox,
    combine: Combine,
    right: int,
    group: Group,
) -> None:
    """Run ``steps`` in place: fold (reduce-scatter) or land (all-gather) each arriving piece.

    What a rank finishes at one step is what it sends at the next, so each piece is sent on
    as soon as it is ready, across steps and phases.
    """
    sends = [isend(p, right, group) for p in pieces[steps[0].send]]
    for i, step in enumerate(steps):
        for piece in pieces[step.recv]:
            incoming = inbox.take()
            if step.phase == REDUCE_SCATTER:
                combine(piece, incoming, piece)
            if i + 1 < len(steps):  # steps[i + 1].send == step.recv
                sends.append(isend(piece, right, group))
    wait_all(sends)


def all_reduce(flat: torch.Tensor, combine: Combine, group: Group) -> None:
    """Ring all-reduce of the contiguous 1-D ``flat`` in place, pipelined piece by piece."""
    rank, world, right, left = _neighbours(group)
    pieces = _chunk_pieces(flat, world)
    steps = ring_schedule(world, rank)
    scratch = [p.numel() for s in steps[: world - 1] for p in pieces[s.recv]]
    gathered = [p for s in steps[world - 1 :] for p in pieces[s.recv]]  # land in place
    inbox = Inbox(flat, [*scratch, *gathered], left, group)
    _pass_around(pieces, steps, inbox, combine, right, group)


def all_gather(flat_out: torch.Tensor, group: Group) -> None:
    """Fill the 1-D ``flat_out`` (``world`` equal chunks, chunk ``rank`` already set) everywhere."""
    rank, world, right, left = _neighbours(group)
    pieces = _chunk_pieces(flat_out, world)
    steps = ring_schedule(world, rank)[world - 1 :]
    inbox = Inbox(flat_out, [p for s in steps for p in pieces[s.recv]], left, group)
    _pass_around(pieces, steps, inbox, _no_combine, right, group)


def _no_combine(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    raise AssertionError("the all-gather phase does not reduce")


def reduce_scatter(
    flat_in: torch.Tensor, out: torch.Tensor, combine: Combine, group: Group
) -> None:
    """Reduce the 1-D ``flat_in`` (``world`` equal chunks) across ranks; chunk ``rank`` -> ``out``.

    ``flat_in`` is only read. Partial sums travel through ``out`` itself, so a piece of ``out``
    is overwritten only once its previous value has been sent.
    """
    rank, world, right, left = _neighbours(group)
    inputs = _chunk_pieces(flat_in, world)
    steps = ring_schedule(world, rank)[: world - 1]
    outs = _chunk_pieces(out, 1)[0]
    inbox = Inbox(out, [p.numel() for _ in steps for p in outs], left, group)
    first = [isend(p, right, group) for p in inputs[steps[0].send]]
    in_flight: list[Any] = [None] * len(outs)
    for i, step in enumerate(steps):
        for j, (mine, dest) in enumerate(zip(inputs[step.recv], outs, strict=True)):
            incoming = inbox.take()
            if in_flight[j] is not None:
                in_flight[j].wait()
            combine(mine, incoming, dest)
            in_flight[j] = isend(dest, right, group) if i + 1 < len(steps) else None
    wait_all(first)
