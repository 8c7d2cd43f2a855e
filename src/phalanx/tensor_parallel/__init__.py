"""Tensor (operator) parallelism, Megatron-LM style (Shoeybi et al., 2019).

Layers hold a slice of each weight; f and g (:mod:`~phalanx.tensor_parallel.functional`)
all-reduce where the math needs it. Apply a plan to an existing model with
:func:`parallelize_module`, or :func:`parallelize_gpt` for :class:`phalanx.models.GPT`::

    group = dist.new_group(ranks)                  # the tensor-parallel ranks
    parallelize_gpt(model, group)                  # in place; same seed on every rank first
    logits, loss = gpt_loss(model, idx, targets)   # vocabulary-parallel cross-entropy
"""

from __future__ import annotations

from phalanx.tensor_parallel.functional import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from phalanx.tensor_parallel.gpt import (
    gpt_comm_counts,
    gpt_loss,
    gpt_plan,
    parallelize_gpt,
    validate_tp,
)
from phalanx.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from phalanx.tensor_parallel.loss import vocab_parallel_cross_entropy
from phalanx.tensor_parallel.plan import STYLES, match_plan, parallelize_module
from phalanx.tensor_parallel.ranges import shard_range, shard_sizes

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "gpt_comm_counts",
    "gpt_loss",
    "gpt_plan",
    "match_plan",
    "parallelize_gpt",
    "parallelize_module",
    "reduce_from_tp",
    "scatter_to_tp",
    "shard_range",
    "shard_sizes",
    "validate_tp",
    "vocab_parallel_cross_entropy",
]
