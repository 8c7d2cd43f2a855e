"""Checkpoints of a dp x pp x tp model: every rank writes the pieces it alone holds.

A pipeline stage's parameters are whole tensors of the original model; a tensor-parallel shard
is a slice along one dimension (rows of a column-parallel weight, columns of a row-parallel
one, rows of a vocabulary table). Both are written as :class:`~phalanx.sharding.state.Piece`
records keyed by the parameter's name in the *unsplit* model, with element ranges of its
flattened full tensor, so a checkpoint saved at one dp x pp x tp layout loads at another, or
into the whole model (``phalanx.checkpoint.load(model=plain_model)``).

Who writes: only data-parallel replica 0 (the replicas are identical), and a parameter that
tensor parallel leaves replicated only from tensor rank 0. Optimizer state follows its
parameter, keyed ``<name>/<state>``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.sharding.shard_optim import ShardedOptimizerState
from phalanx.sharding.state import Piece, PieceReader, ShardedState

__all__ = [
    "FORMAT",
    "ParallelModelState",
    "ParallelOptimizerState",
    "segments_of",
    "tp_slices",
]

FORMAT = "phalanx.mesh-model/1"

Segment = tuple[str, tuple[int, ...], int, int, int]
"""(key, full shape, start, end, offset in the local flattened tensor)."""


def segments_of(key: str, full: tuple[int, ...], dim: int, start: int, end: int) -> list[Segment]:
    """The contiguous runs of a slice ``start:end`` along ``dim`` of a tensor of shape ``full``.

    Row-major: a slice along dim 0 is one run; along dim d there is one run per index of the
    dimensions before d (a column block of a matrix is one run per row).
    """
    outer = 1
    for s in full[:dim]:
        outer *= s
    inner = 1
    for s in full[dim + 1 :]:
        inner *= s
    width, stride = (end - start) * inner, full[dim] * inner
    return [
        (key, full, o * stride + start * inner, o * stride + start * inner + width, o * width)
        for o in range(outer)
    ]


def tp_slices(model: nn.Module) -> dict[int, tuple[int, int, int, int]]:
    """``id(param) -> (dim, start, end, full size)`` for every tensor-parallel shard."""
    from phalanx.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from phalanx.tensor_parallel import VocabParallelEmbedding as Vocab

    out: dict[int, tuple[int, int, int, int]] = {}
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            for p in m.parameters(recurse=False):
                out[id(p)] = (0, m.start, m.start + p.shape[0], m.out_features)
        elif isinstance(m, RowParallelLinear):
            out[id(m.weight)] = (1, m.start, m.start + m.weight.shape[1], m.in_features)
        elif isinstance(m, Vocab):
            out[id(m.weight)] = (0, m.start, m.end, m.num_embeddings)
    return out


def plan_segments(
    model: nn.Module, kept: set[int], tp_rank: int
) -> tuple[list[tuple[nn.Parameter, list[Segment]]], set[int]]:
    """Each kept parameter of ``model`` (by unsplit name) with its segments, and which this
    rank writes (its shards; replicated parameters on tensor rank 0 only)."""
    slices = tp_slices(model)
    layout: list[tuple[nn.Parameter, list[Segment]]] = []
    writes: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in kept:
            continue
        if id(p) in slices:
            dim, start, end, size = slices[id(p)]
            full = tuple(size if d == dim else s for d, s in enumerate(p.shape))
            layout.append((p, segments_of(name, full, dim, start, end)))
            writes.add(id(p))
        else:
            layout.append((p, [(name, tuple(p.shape), 0, p.numel(), 0)]))  # whole
            if tp_rank == 0:
                writes.add(id(p))
    return layout, writes


class ParallelModelState:
    """The :class:`~phalanx.sharding.state.Sharded` view of a split model's parameters and
    buffers (buffers are whole, written by the first rank of each replica group holding them)."""

    def __init__(
        self,
        layout: list[tuple[nn.Parameter, list[Segment]]],
        writes: set[int],
        buffers: dict[str, torch.Tensor],
        write_buffers: bool,
    ) -> None:
        self.layout, self.writes = layout, writes
        self.buffers, self.write_buffers = buffers, write_buffers

    def sharded_state(self) -> ShardedState:
        pieces: list[tuple[Piece, torch.Tensor]] = []
        for p, segs in self.layout:
            if id(p) in self.writes:
                flat = p.detach().reshape(-1)
                pieces += [
                    (_piece(key, shape, a, b, p), flat[off : off + b - a])
                    for key, shape, a, b, off in segs
                ]
        if self.write_buffers:
            for name, t in self.buffers.items():
                pieces.append((_piece(name, tuple(t.shape), 0, t.numel(), t), t.reshape(-1)))
        return ShardedState({"format": FORMAT}, pieces)

    @torch.no_grad()
    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        for p, segs in self.layout:
            flat = torch.empty(p.numel(), dtype=p.dtype)
            for key, _, a, b, off in segs:
                reader.read(key, a, b, out=flat[off : off + b - a])
            p.copy_(flat.view_as(p))
        for name, t in self.buffers.items():
            t.copy_(reader.full(name).view_as(t))


def _piece(key: str, shape: tuple[int, ...], a: int, b: int, t: torch.Tensor) -> Piece:
    return Piece(key, shape, a, b, str(t.dtype).removeprefix("torch."))


class ParallelOptimizerState(ShardedOptimizerState):
    """A plain optimizer over a split model's parameters, as pieces ``<name>/<state>``.

    Every rank restores all of its parameters' state; only the ranks that write a parameter
    (see :func:`plan_segments`) save it. Parameter-group options are kept per group index
    (every rank's rebuilt optimizer has the same groups, some of them empty).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: list[tuple[nn.Parameter, list[Segment]]],
        writes: set[int],
    ) -> None:
        super().__init__(optimizer, [(p, segs) for p, segs in layout])
        self.writes = writes

    def sharded_state(self) -> ShardedState:
        full_layout = self.layout
        self.layout = [(p, segs) for p, segs in full_layout if id(p) in self.writes]
        try:
            state = super().sharded_state()
        finally:
            self.layout = full_layout
        state.meta["group_options"] = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        return state

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        options = meta.get("group_options")
        if options is None or len(options) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(options or [])} parameter groups, this "
                f"one {len(self.optimizer.param_groups)}: build the same optimizer to resume"
            )
        super().load_sharded_state(meta, reader)
        for group, saved in zip(self.optimizer.param_groups, options):
            group.update(saved)
