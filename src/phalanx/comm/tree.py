"""Binomial-tree reduce and broadcast, and the chain broadcast, over point-to-point sends.

In a binomial tree over ``world`` ranks (any size, not only powers of two) rank ``v`` places
from the root has parent ``v - lowbit(v)`` and children ``v + 2^k`` for every ``2^k`` below
``lowbit(v)``. It is ``popcount(v)`` hops deep and a broadcast takes ``ceil(log2 world)``
rounds (MPICH's reduce and broadcast), against ``world - 1`` for a ring. Transfers are
pipelined in pieces, as in ``ring.py``, so a piece moves on down (or up) the tree while the
next one is still arriving, and in the all-reduce the root starts broadcasting a piece as
soon as it is reduced.

Ranks here are group-local. The topology is a pure function (:func:`binomial_tree`,
:func:`chain`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.comm.ring import (
    Combine,
    Group,
    Inbox,
    Span,
    irecv,
    isend,
    piece_elems,
    piece_spans,
    wait_all,
)

__all__ = ["TreeLinks", "all_reduce", "binomial_tree", "broadcast", "chain", "reduce"]


@dataclass(frozen=True)
class TreeLinks:
    """One rank's place in a tree: where data comes from and goes to (group ranks)."""

    parent: int | None
    """The rank this one sends to when reducing (receives from when broadcasting); None at root."""
    children: tuple[int, ...]
    """Ranks below this one, nearest (smallest subtree) first."""


def _check(world: int, root: int) -> None:
    if world < 1 or not 0 <= root < world:
        raise ValueError(f"need 0 <= root < world, got root={root}, world={world}")


def binomial_tree(world: int, root: int) -> list[TreeLinks]:
    """The binomial tree rooted at ``root``: entry ``r`` gives group rank ``r``'s links."""
    _check(world, root)
    links = []
    for rank in range(world):
        v = (rank - root) % world
        low = v & -v if v else 1 << world.bit_length()  # the root's "lowest bit" is above all
        parent = None if v == 0 else (v - low + root) % world
        kids, mask = [], 1
        while mask < low and v + mask < world:
            kids.append((v + mask + root) % world)
            mask <<= 1
        links.append(TreeLinks(parent, tuple(kids)))
    return links


def chain(world: int, root: int) -> list[TreeLinks]:
    """The chain ``root -> root+1 -> ... -> root-1``: a pipelined broadcast's topology."""
    _check(world, root)
    links = []
    for rank in range(world):
        v = (rank - root) % world
        parent = None if v == 0 else (rank - 1) % world
        kids = ((rank + 1) % world,) if v < world - 1 else ()
        links.append(TreeLinks(parent, kids))
    return links


def _arrivals(works: list[Any], spans: list[Span]) -> Iterator[Span]:
    for work, span in zip(works, spans, strict=True):
        work.wait()
        yield span


def _post_down(flat: torch.Tensor, spans: list[Span], links: TreeLinks, group: Group) -> list[Any]:
    """Post the receives of every broadcast piece from the parent, straight into ``flat``."""
    if links.parent is None:
        return []
    return [irecv(flat[a:b], links.parent, group) for a, b in spans]


def _forward(flat: torch.Tensor, ready: Iterable[Span], links: TreeLinks, group: Group) -> None:
    """Send each piece to the children as soon as it is ready (farthest child first)."""
    sends = [isend(flat[a:b], c, group) for a, b in ready for c in links.children[::-1]]
    wait_all(sends)


def _reduce_up(
    flat: torch.Tensor, spans: list[Span], links: TreeLinks, combine: Combine, group: Group
) -> Iterator[Span]:
    """Fold the children's pieces into ``flat`` and send each on to the parent; yield spans."""
    sizes = [b - a for a, b in spans]
    inboxes = [Inbox(flat, sizes, c, group) for c in links.children]
    sends = []
    for a, b in spans:
        for inbox in inboxes:
            combine(flat[a:b], inbox.take(), flat[a:b])
        if links.parent is not None:
            sends.append(isend(flat[a:b], links.parent, group))
        yield a, b
    wait_all(sends)


def broadcast(flat: torch.Tensor, links: TreeLinks, group: Group) -> None:
    """Receive ``flat`` from the parent (unless root) and forward every piece to the children."""
    spans = piece_spans(flat.numel(), piece_elems(flat))
    down = _post_down(flat, spans, links, group)
    _forward(flat, spans if links.parent is None else _arrivals(down, spans), links, group)


def reduce(flat: torch.Tensor, links: TreeLinks, combine: Combine, group: Group) -> None:
    """Reduce up the tree: the root's ``flat`` ends with the result, others' with partials."""
    spans = piece_spans(flat.numel(), piece_elems(flat))
    for _ in _reduce_up(flat, spans, links, combine, group):
        pass


def all_reduce(flat: torch.Tensor, links: TreeLinks, combine: Combine, group: Group) -> None:
    """Reduce up the tree, then broadcast down it; the root forwards each piece once reduced.

    The broadcast receives are posted first: the parent sends a piece back only after this
    rank's contribution to it has been sent (and read), so the early receive is safe.
    """
    spans = piece_spans(flat.numel(), piece_elems(flat))
    down = _post_down(flat, spans, links, group)
    up = _reduce_up(flat, spans, links, combine, group)
    if links.parent is None:
        _forward(flat, up, links, group)
        return
    for _ in up:
        pass
    _forward(flat, _arrivals(down, spans), links, group)
