"""Checkpoints of a dp x pp x tp model: every rank writes the pieces it alone holds.

A pipeline stage's parameters are whole tensors of the original model; a tensor-parallel shard is a
slice along one dimension (rows of a column-parallel weight, columns of a row-parallel one, rows of
a vocabulary table). Both are written as :class:`~phalanx.sharding.pieces.Piece` records keyed by
the parameter's name in the *unsplit* model, with element ranges of its flattened full tensor (a
slice is one piece per contiguous run, :func:`~phalanx.sharding.pieces.slice_pieces`), so a
checkpoint saved at one dp x pp x tp layout loads at another, or into the whole model
(``phalanx.checkpoint.load(model=plain_model)``).

Who writes: only data-parallel replica 0 (the replicas are identical), and a parameter that
tensor parallel leaves replicated only from tensor rank 0. Optimizer state follows its
parameter, keyed ``<name>/<state>``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.sharding.optimizer_pieces import PieceOptimizerState
from phalanx.sharding.pieces import HeldPieces, Piece, PieceReader, ShardedState, slice_pieces

__all__ = [
    "FORMAT",
    "ParallelModelState",
    "ParallelOptimizerState",
    "plan_pieces",
    "tp_slices",
]

FORMAT = "phalanx.mesh-model/1"


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


def plan_pieces(model: nn.Module, kept: set[int], tp_rank: int) -> tuple[HeldPieces, set[int]]:
    """Each kept parameter of ``model`` with its pieces (keyed by unsplit name), and which
    this rank writes (its shards; replicated parameters on tensor rank 0 only)."""
    slices = tp_slices(model)
    layout: HeldPieces = []
    writes: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in kept:
            continue
        if id(p) in slices:
            dim, start, end, size = slices[id(p)]
            full = tuple(size if d == dim else s for d, s in enumerate(p.shape))
            layout.append((p, slice_pieces(name, full, dim, start, end)))
            writes.add(id(p))
        else:
            layout.append((p, [Piece(name, tuple(p.shape), 0, p.numel())]))  # whole
            if tp_rank == 0:
                writes.add(id(p))
    return layout, writes


class ParallelModelState:
    """The :class:`~phalanx.sharding.pieces.Sharded` view of a split model's parameters and
    buffers (buffers are whole, written by the first rank of each replica group holding them)."""

    def __init__(
        self,
        layout: HeldPieces,
        writes: set[int],
        buffers: dict[str, torch.Tensor],
        write_buffers: bool,
    ) -> None:
        self.layout, self.writes = layout, writes
        self.buffers, self.write_buffers = buffers, write_buffers

    def sharded_state(self) -> ShardedState:
        pieces: list[tuple[Piece, torch.Tensor]] = []
        for p, held in self.layout:
            if id(p) in self.writes:
                flat = p.detach().reshape(-1)
                pieces += [(Piece(h.key, h.shape, h.start, h.end), h.held_in(flat)) for h in held]
        if self.write_buffers:
            for name, t in self.buffers.items():
                pieces.append((Piece(name, tuple(t.shape), 0, t.numel()), t.reshape(-1)))
        return ShardedState({"format": FORMAT}, pieces)

    @torch.no_grad()
    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        for p, held in self.layout:
            flat = torch.empty(p.numel(), dtype=p.dtype)
            for h in held:
                reader.read(h.key, h.start, h.end, out=h.held_in(flat))
            p.copy_(flat.view_as(p))
        for name, t in self.buffers.items():
            t.copy_(reader.full(name).view_as(t))


class ParallelOptimizerState(PieceOptimizerState):
    """A plain optimizer over a split model's parameters, as pieces ``<name>/<state>``.

    Every rank restores all of its parameters' state; only the ranks that write a parameter
    (see :func:`plan_pieces`) save it. Parameter-group options are kept per group index
    (every rank's rebuilt optimizer has the same groups, some of them empty).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: HeldPieces,
        writes: set[int],
    ) -> None:
        super().__init__(optimizer, list(layout))
        self.writes = writes

    def sharded_state(self) -> ShardedState:
        full_layout = self.layout
        self.layout = [(p, held) for p, held in full_layout if id(p) in self.writes]
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
