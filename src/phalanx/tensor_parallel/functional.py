"""Megatron-LM's communication operators as autograd functions (Shoeybi et al., 2019, §3).

A tensor-parallel layer is an ordinary matmul between two conjugate operators:

- :func:`copy_to_tp` is Megatron's **f**: identity forward; backward all-reduces (sums) the
  input gradient, because every rank's shard of a column-parallel matmul contributes a partial
  gradient to the replicated input.
- :func:`reduce_from_tp` is Megatron's **g**: forward all-reduces the partial sums of a
  row-parallel matmul; backward is the identity (the output gradient is already replicated).
- :func:`copy_to_tp_linear`: f fused with the column-parallel matmul, so that backward overlaps
  f's all-reduce with the weight gradient (what ``ColumnParallelLinear`` uses).
- :func:`gather_from_tp` / :func:`scatter_to_tp`: all-gather a sharded dimension (backward keeps
  this rank's slice) and the converse. Shards may be uneven (sizes from
  :func:`~phalanx.tensor_parallel.ranges.shard_sizes`), as a 65-token vocabulary on 2 ranks is.

Every collective goes through phalanx's tracked wrappers, so ``phalanx.comm_stats()`` counts it.
On a group of size 1 every operator is the identity and communicates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.comm import collectives as comm
from phalanx.tensor_parallel.ranges import shard_sizes

__all__ = [
    "copy_to_tp",
    "copy_to_tp_linear",
    "gather_from_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "tp_rank",
    "tp_size",
]

Group = dist.ProcessGroup | None


def tp_size(group: Group) -> int:
    """Ranks in ``group`` (``None``: the default group); 1 when no process group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group: Group) -> int:
    """This process's rank within ``group``; 0 when no process group exists."""
    return dist.get_rank(group) if dist.is_initialized() else 0


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # A copy, not in place: autograd may hand the same gradient tensor to other consumers.
        total = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(total, group=ctx.group)
        return total, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, inplace: bool) -> torch.Tensor:
        # In place only where nothing else can hold x: autograd refuses if anything saved it
        # (mark_dirty), and a dispatch mode may have kept it (a selective activation
        # checkpoint keeps the matrix product reduced here: reduced in place, the kept copy
        # would be the sum, and its recomputation would reduce it again).
        if inplace and x.is_contiguous() and not torch._C._len_torch_dispatch_stack():
            ctx.mark_dirty(x)
            out = x
        else:
            out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _CopyToTPLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)  # (..., in) @ (in, out/tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gx = gw = gb = work = None
        # Under autocast the forward's linear ran in grad's dtype (fp16 / bf16): so does this
        # backward, and each gradient comes back in its input's dtype (no-ops otherwise).
        low = grad.dtype
        if ctx.needs_input_grad[0]:
            # (..., out/tp) @ (out/tp, in): fresh, reduce in place
            gx = grad.matmul(weight.to(low)).to(x.dtype)
            work = comm.all_reduce(gx, group=ctx.group, async_op=True)
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out/tp)
        if ctx.needs_input_grad[1]:  # computed while the all-reduce is in flight
            x2 = x.reshape(-1, x.shape[-1]).to(low)  # (N, in)
            gw = g2.t().matmul(x2).to(weight.dtype)  # (out/tp, N) @ (N, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(dim=0).to(weight.dtype)
        if work is not None:
            work.wait()
        return gx, gw, gb, None


def _sizes_for(x: torch.Tensor, group: Group, dim: int, sizes: Sequence[int] | None) -> list[int]:
    tp, rank = tp_size(group), tp_rank(group)
    local = x.shape[dim]
    out = [local] * tp if sizes is None else [int(s) for s in sizes]
    if len(out) != tp or out[rank] != local:
        raise ValueError(
            f"gather_from_tp: sizes={list(out)} must list one size per rank of the group "
            f"(tp={tp}) with this rank's ({rank}) equal to x.shape[{dim}]={local}"
        )
    return out


def _all_gather(x: torch.Tensor, group: Group, dim: int, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; shorter shards are padded to the longest."""
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    x = x.contiguous()
    # Shards concatenated on dim 0, viewed as (tp, *x.shape): one padded shard per rank.
    flat = x.new_empty((len(sizes) * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(flat, x, group=group)
    buf = flat.view(len(sizes), *x.shape)
    return torch.cat([buf[r].narrow(dim, 0, n) for r, n in enumerate(sizes)], dim)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        rank = tp_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        return _all_gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Group, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        rank = tp_rank(group)
        local = x.narrow(dim, sum(sizes[:rank]), sizes[rank])
        return local.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: ``x`` unchanged forward; backward all-reduces (sums) its gradient."""
    if tp_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def copy_to_tp_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group
) -> torch.Tensor:
    """``F.linear(copy_to_tp(x, group), weight, bias)``, with f's all-reduce overlapped.

    Backward starts the all-reduce of the input gradient as soon as it is computed and computes
    the weight and bias gradients while it is in flight (Megatron-LM's asynchronous
    tensor-parallel all-reduce, Narayanan et al., 2021); the result is the same.
    """
    if tp_size(group) == 1:
        return F.linear(x, weight, bias)
    return _CopyToTPLinear.apply(x, weight, bias, group)


def reduce_from_tp(x: torch.Tensor, group: Group, *, inplace: bool = False) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) ``x`` forward; backward passes the gradient through.

    Args:
        x: This rank's partial sum.
        group: The tensor-parallel group.
        inplace: Reduce into ``x`` itself (saves a copy). Only for a fresh tensor nothing else
            holds, such as a matmul's output; autograd raises if something saved it.
    """
    if tp_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group, inplace)


def gather_from_tp(
    x: torch.Tensor, group: Group, dim: int = -1, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` forward; backward keeps this rank's slice of the gradient.

    Args:
        x: This rank's shard.
        group: The tensor-parallel group.
        dim: Dimension to concatenate along.
        sizes: Every rank's shard length along ``dim`` when they differ (see
            :func:`~phalanx.tensor_parallel.ranges.shard_sizes`); ``None``: all equal.
    """
    if tp_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, dim, _sizes_for(x, group, dim, sizes))


def scatter_to_tp(
    x: torch.Tensor, group: Group, dim: int = -1, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` forward; backward all-gathers the gradient.

    ``sizes`` defaults to :func:`~phalanx.tensor_parallel.ranges.shard_sizes` of ``x``'s
    dimension, so an uneven dimension splits as the layers split it.
    """
    tp = tp_size(group)
    if tp == 1:
        return x
    split = shard_sizes(x.shape[dim], tp) if sizes is None else [int(s) for s in sizes]
    if len(split) != tp or sum(split) != x.shape[dim]:
        raise ValueError(
            f"scatter_to_tp: sizes={split} must have tp={tp} entries summing to "
            f"x.shape[{dim}]={x.shape[dim]}"
        )
    return _ScatterToTP.apply(x, group, dim, split)
