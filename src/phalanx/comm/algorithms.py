"""Explicit collective algorithms over point-to-point sends: ring and binomial tree.

These are what ``phalanx.all_reduce(..., algorithm="ring" | "tree")`` runs, and what
``phalanx bench comm`` measures against the backend's own collectives. They take torch's
arguments (global ``src``, ``group=None`` for the default group), work in place like torch's,
accept any shape, size (even 0 or fewer elements than ranks), layout and dtype the reduce op
allows, and give the same result as the native collective (up to the order of floating-point
reduction). They call ``torch.distributed`` directly: the caller tracks them as one operation.

- :func:`ring_all_reduce`: reduce-scatter then all-gather around the ring
  (Patarasuk & Yuan, 2009): bandwidth-optimal, ``2 (n - 1)`` latency steps.
- :func:`tree_all_reduce`: binomial-tree reduce to group rank 0, then binomial broadcast:
  ``2 ceil(log2 n)`` latency steps, each moving the whole buffer.

The communication lives in ``ring.py`` and ``tree.py``; this module checks arguments, maps the
reduce op to a torch function and handles layout, ``AVG`` and the single-rank case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from phalanx.comm import ring, tree
from phalanx.comm.ring import Combine, Group, RingStep, chunk_spans, piece_spans, ring_schedule
from phalanx.comm.tree import TreeLinks, binomial_tree, chain

__all__ = [
    "RingStep",
    "TreeLinks",
    "binomial_tree",
    "chain",
    "chunk_spans",
    "combiner",
    "piece_spans",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
    "ring_reduce_scatter",
    "ring_schedule",
    "tree_all_reduce",
    "tree_broadcast",
]

_OPS: list[tuple[Any, Any]] = [
    (ReduceOp.SUM, torch.add),
    (ReduceOp.AVG, torch.add),  # sum, then divide by the group size
    (ReduceOp.PRODUCT, torch.mul),
    (ReduceOp.MIN, torch.minimum),
    (ReduceOp.MAX, torch.maximum),
    (ReduceOp.BAND, torch.bitwise_and),
    (ReduceOp.BOR, torch.bitwise_or),
    (ReduceOp.BXOR, torch.bitwise_xor),
]
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def combiner(op: Any, dtype: torch.dtype) -> Combine:
    """The elementwise ``combine(a, b, out)`` for reduce op ``op`` on ``dtype`` tensors.

    Raises:
        ValueError: for ``PREMUL_SUM`` or anything that is not a ``ReduceOp``.
        TypeError: for a bitwise op on a floating dtype, or ``AVG`` on a non-floating one.
    """
    fn = next((f for o, f in _OPS if o == op), None)
    if fn is None:
        raise ValueError(
            f"op={op!r} is not supported by phalanx's ring/tree algorithms; "
            "use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR"
        )
    if any(op == b for b in _BITWISE) and _is_float(dtype):
        raise TypeError(f"op=ReduceOp.{_name(op)} needs an integer or bool tensor, got {dtype}")
    if op == ReduceOp.AVG and not _is_float(dtype):
        raise TypeError(f"op=ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    return lambda a, b, out: fn(a, b, out=out)


def _name(op: Any) -> str:
    return str(getattr(op, "name", op))


@contextlib.contextmanager
def _contiguous_flat(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A flat contiguous view of ``tensor`` (or of a copy, written back on exit)."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    yield work.view(-1)
    if work is not tensor:
        tensor.copy_(work)


def _group_rank(global_rank: int, group: Group, arg: str) -> int:
    """Translate the global rank the caller gave (as in torch) to a group rank."""
    if group is None or group is dist.GroupMember.WORLD:
        size = dist.get_world_size()
        if not 0 <= global_rank < size:
            raise ValueError(f"{arg}={global_rank} is not a rank of the group of {size}")
        return global_rank
    try:
        return dist.get_group_rank(group, global_rank)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"{arg}={global_rank} is not a member of the group") from exc


def ring_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None) -> None:
    """All-reduce ``tensor`` in place with the ring algorithm (reduce-scatter + all-gather).

    Args:
        tensor: Any shape, size, layout and dtype that ``op`` allows; same shape on all ranks.
        op: A ``torch.distributed.ReduceOp`` other than ``PREMUL_SUM``.
        group: The process group; None for the default group.

    Raises:
        ValueError: for ``PREMUL_SUM``.
        TypeError: for a bitwise op on floating point, or ``AVG`` on integers or bool.
    """
    _all_reduce(tensor, op, group, lambda flat, combine: ring.all_reduce(flat, combine, group))


def tree_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None) -> None:
    """All-reduce ``tensor`` in place: binomial-tree reduce to group rank 0, then broadcast.

    Arguments and errors as for :func:`ring_all_reduce`.
    """

    def run(flat: torch.Tensor, combine: Combine) -> None:
        links = binomial_tree(dist.get_world_size(group), 0)[dist.get_rank(group)]
        tree.all_reduce(flat, links, combine, group)

    _all_reduce(tensor, op, group, run)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Group, run: Any) -> None:
    combine = combiner(op, tensor.dtype)
    world = dist.get_world_size(group)
    if world <= 1:  # one rank: the result is the input; -1: not a member, nothing to do
        return
    with _contiguous_flat(tensor) as flat:
        run(flat, combine)
        if op == ReduceOp.AVG:
            flat.div_(world)


def ring_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None
) -> None:
    """Reduce ``input`` across ranks; group rank ``r`` gets the ``r``-th equal slice in ``output``.

    Like ``torch.distributed.reduce_scatter_tensor``: ``input`` holds ``world`` slices of
    ``output.numel()`` elements (concatenated or stacked) and is left unchanged.
    """
    combine = combiner(op, input.dtype)
    world = dist.get_world_size(group)
    if world < 1:
        return
    _check_pair(output, input, world, "input", "output")
    flat_in = input.reshape(-1)
    with _contiguous_flat(output) as flat_out:
        if world == 1:
            flat_out.copy_(flat_in)
            return
        ring.reduce_scatter(flat_in, flat_out, combine, group)
        if op == ReduceOp.AVG:
            flat_out.div_(world)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None) -> None:
    """Gather every rank's ``input`` into ``output`` around the ring (``all_gather_into_tensor``).

    ``output`` holds ``world`` slices of ``input.numel()`` elements, in group-rank order.
    """
    world = dist.get_world_size(group)
    if world < 1:
        return
    _check_pair(input, output, world, "output", "input")
    rank, n = dist.get_rank(group), input.numel()
    with _contiguous_flat(output) as flat_out:
        flat_out[rank * n : (rank + 1) * n].copy_(input.reshape(-1))
        if world > 1:
            ring.all_gather(flat_out, group)


def _check_pair(
    small: torch.Tensor, big: torch.Tensor, world: int, big_name: str, small_name: str
) -> None:
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{big_name} must hold world_size={world} times the {small.numel()} elements of "
            f"{small_name}, got {big.numel()}"
        )
    if big.dtype != small.dtype:
        raise TypeError(f"{big_name} is {big.dtype} but {small_name} is {small.dtype}")


def tree_broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """Broadcast ``tensor`` from global rank ``src`` down a pipelined binomial tree."""
    _broadcast(tensor, src, group, binomial_tree)


def ring_broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """Broadcast ``tensor`` from global rank ``src`` along a pipelined chain of the ranks."""
    _broadcast(tensor, src, group, chain)


def _broadcast(tensor: torch.Tensor, src: int, group: Group, topology: Any) -> None:
    world = dist.get_world_size(group)
    root = _group_rank(src, group, "src") if world >= 1 else 0
    if world <= 1:
        return
    links = topology(world, root)[dist.get_rank(group)]
    with _contiguous_flat(tensor) as flat:
        tree.broadcast(flat, links, group)
