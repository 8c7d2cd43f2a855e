"""Megatron-LM's tensor-parallel layers (Shoeybi et al., 2019): each rank holds a slice.

- :class:`ColumnParallelLinear` splits the output features: rank r holds rows
  ``[r*out/tp, (r+1)*out/tp)`` of the weight and computes that slice of the output. Its input
  passes through f (:func:`~phalanx.tensor_parallel.functional.copy_to_tp`).
- :class:`RowParallelLinear` splits the input features: rank r holds the matching columns, takes
  its slice of the input and all-reduces the partial products through g
  (:func:`~phalanx.tensor_parallel.functional.reduce_from_tp`).
- :class:`VocabParallelEmbedding` splits the rows of the table; ids another rank owns look up
  zeros, and g sums the ranks' lookups.

Column then row (an MLP's fc1 and fc2, attention's q/k/v and out projection) costs one f and
one g: one all-reduce forward, one backward. Built directly, a layer draws the full dense
weight exactly as ``nn.Linear`` / ``nn.Embedding`` would and keeps its slice, so the same seed
gives the same model at any ``tp`` (Megatron's "master weight" initialisation; the full weight
exists transiently). :meth:`from_dense` slices an existing dense layer instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx._check import (
    FLAG,
    GROUP,
    check_instance,
    check_int,
    checked,
    optional,
    rule,
)
from phalanx.tensor_parallel.functional import (
    copy_to_tp_linear,
    gather_from_tp,
    reduce_from_tp,
    tp_rank,
    tp_size,
)
from phalanx.tensor_parallel.ranges import shard_range, shard_sizes

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

Group = dist.ProcessGroup | None

_size = rule(check_int, min=1)
_dtype = optional(rule(check_instance, types=torch.dtype, what="a torch.dtype, e.g. torch.float32"))
_device = optional(rule(check_instance, types=str | int | torch.device, what="a device"))
_common = {"group": GROUP, "device": _device, "dtype": _dtype}


def _dense_linear(
    out_features: int, in_features: int, bias: bool, factory: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight and bias drawn as ``nn.Linear.reset_parameters`` draws them, same RNG order."""
    weight = torch.empty(out_features, in_features, **factory)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
    return weight, torch.empty(out_features, **factory).uniform_(-bound, bound)


def _type_error(cls: type, module: nn.Module, expected: type) -> TypeError:
    return TypeError(
        f"{cls.__name__}.from_dense needs an nn.{expected.__name__}, got {type(module).__name__}"
    )


def _empty_like_dense(cls: type, module: nn.Module, **kwargs: Any) -> Any:
    """``cls(**kwargs)`` allocated on the meta device, then moved (uninitialised) beside module."""
    weight = module.weight
    layer = cls(**kwargs, device="meta", dtype=weight.dtype)
    return layer.to_empty(device=weight.device)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with the output features split over the tensor-parallel group.

    Args:
        in_features: Input width (replicated on every rank).
        out_features: Full output width; this rank computes its :attr:`sizes`-th share.
        bias: Learn an additive bias (sharded like the output).
        group: The tensor-parallel process group (``None``: the default group).
        gather_output: All-gather the output so every rank gets all ``out_features``.
        sync_input_grad: Apply f to the input (all-reduce its gradient in backward). Turn off
            when f was already applied once to an input shared by several column layers
            (the plan style ``"parallel_input"`` does this for attention's q/k/v).
        allow_uneven: Let ``out_features`` not divide by the group size; shards then differ by
            at most one row (a vocabulary-sized head).
        device: Where to allocate the shard.
        dtype: Parameter dtype.
    """

    @checked(
        in_features=_size,
        out_features=_size,
        bias=FLAG,
        gather_output=FLAG,
        sync_input_grad=FLAG,
        allow_uneven=FLAG,
        **_common,
    )
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group,
        gather_output: bool = False,
        sync_input_grad: bool = True,
        allow_uneven: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp, rank = tp_size(group), tp_rank(group)
        if out_features % tp and not allow_uneven:
            raise ValueError(
                f"ColumnParallelLinear: out_features={out_features} is not divisible by "
                f"tp={tp} (the tensor-parallel group size)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.sync_input_grad = group, gather_output, sync_input_grad
        self.sizes = shard_sizes(out_features, tp)
        self.start, end = shard_range(out_features, rank, tp)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(end - self.start, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(end - self.start, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the dense ``nn.Linear`` weight and bias, keep this rank's rows."""
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        weight, bias = _dense_linear(
            self.out_features, self.in_features, self.bias is not None, factory
        )
        self.copy_from_dense(weight, bias)

    @torch.no_grad()
    def copy_from_dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Load this rank's rows of a dense (out_features, in_features) weight and its bias."""
        rows = slice(self.start, self.start + self.weight.shape[0])
        self.weight.copy_(weight[rows])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[rows])

    @classmethod
    def from_dense(
        cls,
        module: nn.Module,
        group: Group,
        *,
        gather_output: bool = False,
        sync_input_grad: bool = True,
        allow_uneven: bool = False,
    ) -> ColumnParallelLinear:
        """The column-parallel shard of an ``nn.Linear``: same outputs as the dense layer."""
        if not isinstance(module, nn.Linear):
            raise _type_error(cls, module, nn.Linear)
        layer: ColumnParallelLinear = _empty_like_dense(
            cls,
            module,
            in_features=module.in_features,
            out_features=module.out_features,
            bias=module.bias is not None,
            group=group,
            gather_output=gather_output,
            sync_input_grad=sync_input_grad,
            allow_uneven=allow_uneven,
        )
        layer.copy_from_dense(module.weight, module.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features / tp), or (..., out_features) if gathered."""
        if self.sync_input_grad:  # f, its all-reduce overlapped with the weight gradient
            y = copy_to_tp_linear(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(x, self.weight, self.bias)  # (..., in) @ (in, out/tp)
        return gather_from_tp(y, self.group, -1, self.sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local={tuple(self.weight.shape)}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sync_input_grad={self.sync_input_grad}"
        )


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with the input features split; its input arrives sharded on the last dim.

    The bias is replicated and added once, after g: adding it before the all-reduce would count
    it ``tp`` times.

    Args:
        in_features: Full input width; this rank takes ``in_features / tp`` of it.
        out_features: Output width (replicated on every rank).
        bias: Learn an additive bias.
        group: The tensor-parallel process group (``None``: the default group).
        device: Where to allocate the shard.
        dtype: Parameter dtype.
    """

    @checked(in_features=_size, out_features=_size, bias=FLAG, **_common)
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Group,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp, rank = tp_size(group), tp_rank(group)
        if in_features % tp:
            raise ValueError(
                f"RowParallelLinear: in_features={in_features} is not divisible by "
                f"tp={tp} (the tensor-parallel group size)"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.start, end = shard_range(in_features, rank, tp)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, end - self.start, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the dense ``nn.Linear`` weight and bias, keep this rank's columns."""
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        weight, bias = _dense_linear(
            self.out_features, self.in_features, self.bias is not None, factory
        )
        self.copy_from_dense(weight, bias)

    @torch.no_grad()
    def copy_from_dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Load this rank's columns of a dense (out_features, in_features) weight, all the bias."""
        self.weight.copy_(weight[:, self.start : self.start + self.weight.shape[1]])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    @classmethod
    def from_dense(cls, module: nn.Module, group: Group) -> RowParallelLinear:
        """The row-parallel shard of an ``nn.Linear``: same outputs as the dense layer."""
        if not isinstance(module, nn.Linear):
            raise _type_error(cls, module, nn.Linear)
        layer: RowParallelLinear = _empty_like_dense(
            cls,
            module,
            in_features=module.in_features,
            out_features=module.out_features,
            bias=module.bias is not None,
            group=group,
        )
        layer.copy_from_dense(module.weight, module.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features / tp) -> (..., out_features)."""
        partial = F.linear(x, self.weight)  # (..., in/tp) @ (in/tp, out): a partial sum
        # The matmul's output is fresh and saved by nothing: reduce it in place.
        y = reduce_from_tp(partial, self.group, inplace=True)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local={tuple(self.weight.shape)}, bias={self.bias is not None}"
        )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the rows split: rank r holds ids ``[start, end)`` (may be uneven).

    Args:
        num_embeddings: Full vocabulary size; shards differ by at most one row.
        embedding_dim: Width of each embedding (replicated).
        group: The tensor-parallel process group (``None``: the default group).
        device: Where to allocate the shard.
        dtype: Parameter dtype.
    """

    @checked(num_embeddings=_size, embedding_dim=_size, **_common)
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp, rank = tp_size(group), tp_rank(group)
        if num_embeddings < tp:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is smaller than "
                f"tp={tp}; every rank needs at least one row"
            )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.start, self.end = shard_range(num_embeddings, rank, tp)
        self.weight = nn.Parameter(
            torch.empty(self.end - self.start, embedding_dim, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the dense table from N(0, 1) as ``nn.Embedding`` does, keep this rank's rows."""
        table = torch.empty(
            self.num_embeddings,
            self.embedding_dim,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        self.copy_from_dense(nn.init.normal_(table))

    @torch.no_grad()
    def copy_from_dense(self, weight: torch.Tensor) -> None:
        """Load this rank's rows of a dense (num_embeddings, embedding_dim) table."""
        self.weight.copy_(weight[self.start : self.end])

    @classmethod
    def from_dense(cls, module: nn.Module, group: Group) -> VocabParallelEmbedding:
        """The vocabulary-parallel shard of an ``nn.Embedding``: same lookups as the dense one."""
        if not isinstance(module, nn.Embedding):
            raise _type_error(cls, module, nn.Embedding)
        for option in ("padding_idx", "max_norm"):
            if getattr(module, option) is not None:
                raise ValueError(
                    f"VocabParallelEmbedding.from_dense: {option} is not supported, "
                    f"got {option}={getattr(module, option)}"
                )
        if module.sparse or module.scale_grad_by_freq:
            raise ValueError(
                "VocabParallelEmbedding.from_dense: sparse and scale_grad_by_freq are not "
                f"supported, got sparse={module.sparse}, "
                f"scale_grad_by_freq={module.scale_grad_by_freq}"
            )
        layer: VocabParallelEmbedding = _empty_like_dense(
            cls,
            module,
            num_embeddings=module.num_embeddings,
            embedding_dim=module.embedding_dim,
            group=group,
        )
        layer.copy_from_dense(module.weight)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(...) int ids -> (..., embedding_dim), summed over the ranks that own them."""
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight)  # (..., D); other ranks' ids looked up row 0
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        # Exactly one rank owns each id, so the sum is that rank's row. masked_fill's output is
        # fresh and saved by nothing: reduce it in place.
        return reduce_from_tp(rows, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"rows=[{self.start}, {self.end})"
        )
