"""Horovod's sparse all-reduce: all-gather the indices and values of sparse COO tensors.

Summing sparse tensors across ranks is concatenating them: every rank's ``(indices, values)``
pairs, all-gathered, form a sparse tensor with repeated indices, which torch sums when it is
coalesced (or an optimizer reads it). ``op=hvd.Average`` divides the values by the set size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.horovod.allgather import allgather_async
from phalanx.horovod.allreduce import resolve_op
from phalanx.horovod.handle import synchronize
from phalanx.horovod.process_sets import resolve
from phalanx.horovod.protocol import ReduceOp

__all__ = ["sparse_allreduce_async"]


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
) -> Callable[[], torch.Tensor]:
    """Start summing (or averaging) a sparse COO tensor across ranks.

    Args:
        tensor: A sparse COO tensor (the same dense shape on every rank).
        name: Names the two all-gathers ``<name>.indices`` and ``<name>.values``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: An ``hvd.ProcessSet``; None for all ranks.

    Returns:
        A function that waits and returns the reduced sparse tensor (Horovod returns one too).
    """
    op = resolve_op(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(
            f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got hvd.{op.name}"
        )
    if not tensor.is_sparse:
        raise ValueError(
            f"sparse_allreduce_async takes a sparse COO tensor, got a "
            f"{tensor.layout} one; use allreduce for dense tensors"
        )
    ps = resolve(process_set)
    # allgather concatenates along dimension 0: indices travel transposed, one row per entry.
    indices = allgather_async(
        tensor._indices().t().contiguous(), None if name is None else f"{name}.indices", ps
    )
    values = allgather_async(tensor._values(), None if name is None else f"{name}.values", ps)

    def result() -> torch.Tensor:
        v, i = synchronize(values), synchronize(indices)
        if op == ReduceOp.Average:
            v = v / len(ps.ranks)
        return torch.sparse_coo_tensor(i.t(), v, tensor.shape)

    return result
