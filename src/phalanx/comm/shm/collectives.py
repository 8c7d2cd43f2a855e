"""The collectives on a :class:`Channel`: copy in, arrive, compute with torch ops, copy out.

Each large message goes through in chunks of one slot. Why two parities make this safe: a rank
writes only its own slot (and its own share of the result) of the current step's parity, and
only after the first barrier of a step does anyone read another rank's slot. A rank reaches the
first barrier of step s + 1 only after it has finished reading step s, so when a fast rank is
past that barrier and writes parity s % 2 again (at step s + 2), every peer is done with it.

- all_reduce / reduce: everyone copies in; barrier; rank r reduces the r-th 1/n of every slot
  into the result; barrier; everyone (reduce: the root) copies the result out.
- broadcast: the root copies in; barrier; the others copy out.
- all_gather: everyone copies in; barrier; everyone copies every slot out.
- reduce_scatter: everyone copies in; barrier; rank r reduces its block of every slot straight
  into its output.
- all_to_all: a first step exchanges the split sizes (checked on every rank); then rounds in
  which each rank puts up to 1/n of a slot for every destination.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phalanx.comm.errors import CollectiveMismatchError
from phalanx.comm.shm.channel import Channel
from phalanx.comm.shm.ops import reduce_into

ONE_SHOT_BYTES = 256 << 10
ONE_SHOT_RANKS = 2

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "reduce_scatter",
    "share",
]


def _chunks(numel: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most ``size`` covering 0..numel; one empty range when numel is 0."""
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)] or [(0, 0)]


def share(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The [lo, hi) part of 0..numel that ``rank`` reduces: near-equal, in rank order."""
    base, extra = divmod(numel, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def barrier(ch: Channel) -> None:
    ch.first_barrier(ch.next_step())


def all_reduce(ch: Channel, flat: torch.Tensor, op: int, root: int | None = None) -> None:
    """Reduce ``flat`` in place over the group (``root`` set: only the root receives).

    One-shot (every rank reduces whole slots straight into its tensor: one barrier) up to
    ``ONE_SHOT_RANKS`` ranks, where it also moves fewer bytes in all, and for messages up to
    ``ONE_SHOT_BYTES``; two-shot (rank r reduces the r-th 1/n into the result area, then all
    copy it: two barriers, 1/n of the arithmetic each) for larger ones. Both add in rank order.
    """
    numel, dtype = flat.numel(), flat.dtype
    one_shot = ch.world_size <= ONE_SHOT_RANKS or numel * dtype.itemsize <= ONE_SHOT_BYTES
    if one_shot and numel <= ch.capacity(dtype) and (root is None or root == ch.rank):
        _one_shot_all_reduce(ch, flat, op)  # one chunk: the same step as below, fewer calls
        return
    for i, (lo, hi) in enumerate(_chunks(flat.numel(), ch.capacity(flat.dtype))):
        parity, m = ch.next_step(), hi - lo
        part = flat if m == flat.numel() else flat[lo:hi]
        ch.slot(parity, ch.rank, flat.dtype, m).copy_(part)
        if i == 0:
            ch.first_barrier(parity)
        else:
            ch.barrier()
        if one_shot:
            if root is None or root == ch.rank:
                slots = [ch.slot(parity, q, flat.dtype, m) for q in range(ch.world_size)]
                reduce_into(part, slots, op)
        else:
            _two_shot(ch, parity, part, op, root)


def _one_shot_all_reduce(ch: Channel, flat: torch.Tensor, op: int) -> None:
    """One step of one chunk: copy in, the call's barrier, reduce every slot into ``flat``."""
    parity, m, dtype = ch.next_step(), flat.numel(), flat.dtype
    ch.slot(parity, ch.rank, dtype, m).copy_(flat)
    ch.first_barrier(parity)
    reduce_into(flat, [ch.slot(parity, q, dtype, m) for q in range(ch.world_size)], op)


def _two_shot(ch: Channel, parity: int, part: torch.Tensor, op: int, root: int | None) -> None:
    m, dtype = part.numel(), part.dtype
    a, b = share(m, ch.world_size, ch.rank)
    slots = [ch.slot(parity, q, dtype)[a:b] for q in range(ch.world_size)]
    result = ch.result(parity, dtype, m)
    reduce_into(result[a:b], slots, op)
    ch.barrier()
    if root is None or root == ch.rank:
        part.copy_(result)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    for i, (lo, hi) in enumerate(_chunks(flat.numel(), ch.capacity(flat.dtype))):
        parity, m = ch.next_step(), hi - lo
        if ch.rank == root:
            ch.slot(parity, root, flat.dtype)[:m].copy_(flat[lo:hi])
        if i == 0:
            ch.first_barrier(parity)
        else:
            ch.barrier()
        if ch.rank != root:
            flat[lo:hi].copy_(ch.slot(parity, root, flat.dtype)[:m])


def all_gather(ch: Channel, outputs: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """``outputs[q]`` (flat, each like ``flat``) receives rank q's ``flat``."""
    for i, (lo, hi) in enumerate(_chunks(flat.numel(), ch.capacity(flat.dtype))):
        parity, m = ch.next_step(), hi - lo
        ch.slot(parity, ch.rank, flat.dtype)[:m].copy_(flat[lo:hi])
        if i == 0:
            ch.first_barrier(parity)
        else:
            ch.barrier()
        for q, out in enumerate(outputs):
            out[lo:hi].copy_(ch.slot(parity, q, flat.dtype)[:m])


def reduce_scatter(ch: Channel, out: torch.Tensor, flat: torch.Tensor, op: int) -> None:
    """``out`` (k elements) = the reduction over ranks of block ``rank`` of ``flat`` (n * k)."""
    n, k = ch.world_size, out.numel()
    blocks = flat.view(n, k) if k else flat.view(n, 0)
    for i, (lo, hi) in enumerate(_chunks(k, max(1, ch.capacity(flat.dtype) // n))):
        parity, m = ch.next_step(), hi - lo
        ch.slot(parity, ch.rank, flat.dtype)[: n * m].view(n, m).copy_(blocks[:, lo:hi])
        if i == 0:
            ch.first_barrier(parity)
        else:
            ch.barrier()
        mine = slice(ch.rank * m, (ch.rank + 1) * m)
        reduce_into(out[lo:hi], [ch.slot(parity, q, flat.dtype)[mine] for q in range(n)], op)


def all_to_all(
    ch: Channel,
    out: torch.Tensor,
    flat: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
) -> None:
    """Rank r's ``flat`` part d (``send_counts[d]`` elements) lands in rank d's ``out`` part r."""
    n, rank = ch.world_size, ch.rank
    sends = _exchange_counts(ch, send_counts, recv_counts)
    piece = max(1, ch.capacity(flat.dtype) // n)
    rounds = max((c + piece - 1) // piece for row in sends for c in row)
    send_at = _offsets(send_counts)
    recv_at = _offsets(recv_counts)
    for k in range(rounds):
        parity, lo = ch.next_step(), k * piece
        mine = ch.slot(parity, rank, flat.dtype)
        for d in range(n):
            m = max(0, min(piece, send_counts[d] - lo))
            start = send_at[d] + lo
            mine[d * piece : d * piece + m].copy_(flat[start : start + m])
        ch.barrier()
        for q in range(n):
            m = max(0, min(piece, recv_counts[q] - lo))
            start = recv_at[q] + lo
            theirs = ch.slot(parity, q, flat.dtype)
            out[start : start + m].copy_(theirs[rank * piece : rank * piece + m])


def _offsets(counts: Sequence[int]) -> list[int]:
    at, total = [], 0
    for c in counts:
        at.append(total)
        total += c
    return at


def _exchange_counts(
    ch: Channel, send_counts: Sequence[int], recv_counts: Sequence[int]
) -> list[list[int]]:
    """Every rank's send counts, checked against the receive counts (same verdict on every rank)."""
    n, parity = ch.world_size, ch.next_step()
    header = torch.tensor([*send_counts, *recv_counts], dtype=torch.int64)
    ch.slot(parity, ch.rank, torch.int64)[: 2 * n].copy_(header)
    ch.first_barrier(parity)
    table = [ch.slot(parity, q, torch.int64)[: 2 * n].tolist() for q in range(n)]
    sends, recvs = [row[:n] for row in table], [row[n:] for row in table]
    for src in range(n):
        for dst in range(n):
            if sends[src][dst] != recvs[dst][src]:
                raise CollectiveMismatchError(
                    f"{ch.what()}: rank {src} sends {sends[src][dst]} elements to rank {dst}, "
                    f"but rank {dst} expects {recvs[dst][src]} from rank {src}; the split "
                    "sizes must pair up (input_split_sizes of one rank = output_split_sizes of "
                    "the other)"
                )
    return sends
