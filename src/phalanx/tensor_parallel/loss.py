"""Cross-entropy over vocabulary-sharded logits, without gathering them (Megatron-LM, §3).

Rank r holds logits ``x[:, s_r:e_r]`` of a vocabulary split by
:func:`~phalanx.tensor_parallel.ranges.shard_range`. The loss of row i is
``log(sum_v exp(x_iv - m_i)) - (x_i,t_i - m_i)`` with ``m_i`` the row's maximum (for a
stable exp), so three reductions over the vocabulary suffice: a MAX of the local maxima, a SUM
of the local exp-sums and a SUM of the target logit (only the owning rank contributes it). The
two sums travel in one all-reduce: two collectives per call, a few bytes per row instead of
the ``V`` floats per row an all-gather of the logits would move. Backward is local:
``softmax - onehot`` on this rank's columns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.comm import collectives as comm
from phalanx.tensor_parallel.functional import tp_rank, tp_size
from phalanx.tensor_parallel.ranges import shard_range

__all__ = ["vocab_parallel_cross_entropy"]

Group = dist.ProcessGroup | None
REDUCTIONS = ("mean", "sum", "none")


def _global_max(x: torch.Tensor, group: Group, check_even: bool) -> torch.Tensor:
    """Row maxima over all ranks; with ``check_even``, also prove every shard has x's width."""
    local = x.max(dim=-1).values  # (N,)
    if not check_even:
        comm.all_reduce(local, dist.ReduceOp.MAX, group=group)
        return local
    n = float(x.shape[-1])
    # Piggyback max(n) and max(-n) = -min(n) on the same all-reduce: no extra collective.
    buf = torch.cat([local, local.new_tensor([n, -n])])
    comm.all_reduce(buf, dist.ReduceOp.MAX, group=group)
    widest, narrowest = float(buf[-2]), -float(buf[-1])
    if widest != narrowest:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logit shards range from {narrowest:.0f} to "
            f"{widest:.0f} columns over the group; an uneven vocabulary needs vocab_size="
        )
    return buf[:-2]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Group,
        layout: tuple[int, int, bool],
        ignore_index: int,
        reduction: str,
    ) -> torch.Tensor:
        start, vocab, check_even = layout
        n = logits.shape[-1]
        x = logits.reshape(-1, n).to(torch.promote_types(logits.dtype, torch.float32))
        t = targets.reshape(-1)
        m = _global_max(x, group, check_even)  # first: it proves an even split's vocab size
        valid = t != ignore_index
        if bool((valid & ((t < 0) | (t >= vocab))).any()):
            raise ValueError(f"vocab_parallel_cross_entropy: a target is outside [0, {vocab})")
        exp = (x - m[:, None]).exp_()  # (N, n), entries in (0, 1]
        owned = (t >= start) & (t < start + n)
        col = (t - start).masked_fill(~owned, 0)
        picked = (x.gather(1, col[:, None]).squeeze(1) - m) * owned  # shifted target logit or 0
        sums = torch.stack([exp.sum(dim=-1), picked])  # (2, N): exp-sum and target, one call
        comm.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp[:, None])  # this rank's columns of softmax(x)
        ctx.save_for_backward(softmax, col, owned, valid)
        ctx.reduction, ctx.shape, ctx.dtype = reduction, logits.shape, logits.dtype
        ctx.count = valid.sum()
        if reduction == "none":
            return losses.reshape(targets.shape).to(logits.dtype)
        total = losses.sum()
        return (total / ctx.count if reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, col, owned, valid = ctx.saved_tensors
        scale = grad.reshape(-1).to(softmax.dtype) * valid  # (N,) or broadcast scalar
        if ctx.reduction == "mean":
            scale = scale / ctx.count
        # d loss_i / d x_iv = softmax_iv - [v == t_i], scaled by the loss's gradient.
        g = softmax * scale[:, None]
        g.scatter_add_(1, col[:, None], (-scale * owned)[:, None])
        return g.reshape(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, computed from this rank's vocabulary shard.

    Args:
        local_logits: (..., V_local): this rank's columns of the logits, as a ``"vocab_head"``
            :class:`~phalanx.tensor_parallel.layers.ColumnParallelLinear` produces them.
        targets: (...) int64 token ids in ``[0, vocab_size)`` or ``ignore_index``.
        group: The tensor-parallel process group (``None``: the default group).
        vocab_size: Full vocabulary; shards follow
            :func:`~phalanx.tensor_parallel.ranges.shard_range`. Required when it does not
            divide by the group size; ``None`` means an even split, and is checked.
        ignore_index: Target value that contributes no loss and no gradient.
        reduction: "mean" (over non-ignored targets), "sum" or "none" (shape of ``targets``).

    Returns:
        The loss, identical on every rank of the group.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    n, tp, rank = local_logits.shape[-1], tp_size(group), tp_rank(group)
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: local_logits shape {tuple(local_logits.shape)} "
            f"needs targets of shape {tuple(local_logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if tp == 1:
        if vocab_size is not None and vocab_size != n:
            raise ValueError(f"vocab_size={vocab_size} but the logits have {n} columns (tp=1)")
        return F.cross_entropy(
            local_logits.reshape(-1, n),
            targets.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        ).reshape(targets.shape if reduction == "none" else ())
    if vocab_size is None:
        layout = (rank * n, n * tp, True)
    else:
        start, end = shard_range(vocab_size, rank, tp)
        if end - start != n:
            raise ValueError(
                f"vocab_parallel_cross_entropy: rank {rank} of tp={tp} owns {end - start} of "
                f"vocab_size={vocab_size} columns, but local_logits has {n}"
            )
        layout = (start, vocab_size, False)
    return _VocabParallelCE.apply(local_logits, targets, group, layout, ignore_index, reduction)
