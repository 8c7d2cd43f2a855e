"""Checkpoints of replicas that drift apart: each rank's own model and inner optimizer state.

Between synchronisations every LocalSGD / DiLoCo replica holds different parameters, and its
inner optimizer (AdamW's moments) differs for good; a checkpoint of rank 0's alone would resume
every rank as rank 0. So each rank writes its model state and optimizer state as
:class:`~phalanx.sharding.pieces.Piece` records of a tensor with a leading replica dimension:
``replica/<name>`` of shape ``(world_size, *shape)``, rank ``r`` holding row ``r``. Rank 0
also writes the state the ranks share (DiLoCo's global parameters θ under the parameters' own
names, so that ``checkpoint.load(path, model=plain_model, strict=False)`` exports θ; its outer
momentum) and ``meta``: the format, the world size and the steps since the last
synchronisation (with ``late_policy="weighted"`` also the rounds done, which name the next
round's announcement). A job resumes at the world size that saved it (its replicas are per
rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.local_sgd.periodic import PeriodicSync
from phalanx.mesh.checkpoint import ParallelOptimizerState
from phalanx.sharding.pieces import HeldPieces, Piece, PieceReader, ShardedState

__all__ = ["FORMAT", "ReplicaModelState", "replica_optimizer_state", "replica_piece"]

FORMAT = "phalanx.replicas/1"
REPLICA = "replica/"
SCALAR = "scalar/"


def replica_piece(name: str, t: torch.Tensor, rank: int, world_size: int) -> Piece:
    """Row ``rank`` of ``replica/<name>``: every rank's copy of ``t`` stacked."""
    n = t.numel()
    return Piece(REPLICA + name, (world_size, *t.shape), rank * n, (rank + 1) * n)


class ReplicaModelState:
    """The :class:`~phalanx.sharding.pieces.Sharded` view of one rank's replica and of the
    state that :class:`PeriodicSync` shares over the ranks.

    Args:
        model: This rank's model (its ``state_dict()`` is its replica).
        sync: The algorithm (its step count and shared state are saved with the model).
        rank: This rank in the replicas' group.
        world_size: Replicas.
    """

    def __init__(self, model: nn.Module, sync: PeriodicSync, rank: int, world_size: int) -> None:
        self.model, self.sync = model, sync
        self.rank, self.world_size = rank, world_size

    def sharded_state(self) -> ShardedState:
        own = self.model.state_dict()
        pieces = [
            (replica_piece(k, t, self.rank, self.world_size), t.detach().reshape(-1))
            for k, t in own.items()
        ]
        if self.rank == 0:
            for k, t in self.sync.shared_state().items():
                pieces.append((Piece(k, tuple(t.shape), 0, t.numel()), t.reshape(-1)))
        meta = {"format": FORMAT, "world_size": self.world_size, "steps": self.sync.steps}
        if self.sync.late is not None:
            meta["rounds"] = self.sync.late.round
        return ShardedState(meta, pieces)

    @torch.no_grad()
    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        self._check(meta)
        for k, t in self.model.state_dict().items():
            piece = replica_piece(k, t, self.rank, self.world_size)
            t.copy_(reader.read(piece.key, piece.start, piece.end).view_as(t))
        shared = {k: reader.full(k) for k in reader.keys() if not k.startswith(REPLICA)}  # noqa: SIM118
        self.sync.load_shared_state(shared)
        self.sync.steps = int(meta["steps"])
        if self.sync.late is not None:
            self.sync.late.round = int(meta.get("rounds", 0))

    def _check(self, meta: dict[str, Any]) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"the checkpoint's model has format {meta.get('format')!r}, not {FORMAT!r}: it "
                f"was not saved by LocalSGD or DiLoCo, whose replicas are per rank"
            )
        saved = meta.get("world_size")
        if saved != self.world_size:
            raise ValueError(
                f"the checkpoint holds {saved} replicas (LocalSGD / DiLoCo keep one per rank), "
                f"the job has world_size={self.world_size}: resume at world_size={saved}"
            )
        steps = meta.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the checkpoint's steps since the last sync is {steps!r}")


class _ReplicaOptimizerState(ParallelOptimizerState):
    """Restores only the parameters whose state the checkpoint holds (a frozen or unused
    parameter has none: AdamW never stepped it).

    Tensor scalars (AdamW's ``step``) are per rank too: with ``late_policy="weighted"`` the
    replicas take different numbers of steps. Each rank writes its own as row ``rank`` of
    ``replica/scalar/<name>/<state>`` (``meta`` keeps rank 0's, all older checkpoints have).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, layout: HeldPieces, rank: int, world_size: int
    ) -> None:
        super().__init__(optimizer, layout, {id(p) for p, _ in layout})
        self.rank, self.world_size = rank, world_size

    def _scalar_pieces(self) -> list[tuple[Piece, dict[str, Any], str]]:
        """(piece, the parameter's state, the state's name) of every 0-dim tensor state."""
        out = []
        for p, held in self.layout:
            state = self.optimizer.state.get(p, {})
            name = held[0].key[len(REPLICA) :]
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    key = f"{REPLICA}{SCALAR}{name}/{k}"
                    out.append((Piece(key, (self.world_size,), self.rank, self.rank + 1), state, k))
        return out

    def sharded_state(self) -> ShardedState:
        state = super().sharded_state()
        for piece, held, k in self._scalar_pieces():
            state.pieces.append((piece, held[k].detach().reshape(1)))
        return state

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        self._load_per_element(meta, reader)
        saved = set(reader.keys())
        for piece, held, k in self._scalar_pieces():
            if piece.key in saved:
                value = reader.read(piece.key, piece.start, piece.end)
                held[k] = value.view(()).to(held[k]).clone()

    def _load_per_element(self, meta: dict[str, Any], reader: PieceReader) -> None:
        saved = set(reader.keys())
        names = meta.get("per_element", [])
        every = self.layout
        self.layout = [
            (p, held)
            for p, held in every
            if all(h.of_state(k).key in saved for h in held for k in names)
        ]
        try:
            super().load_sharded_state(meta, reader)
        finally:
            self.layout = every


def replica_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> ParallelOptimizerState:
    """The inner optimizer's state of this rank, keyed ``replica/<name>/<state>`` (row
    ``rank``), per-group options kept (written by every rank)."""
    layout: HeldPieces = [
        (p, [replica_piece(n, p, rank, world_size)]) for n, p in model.named_parameters()
    ]
    return _ReplicaOptimizerState(optimizer, layout, rank, world_size)
