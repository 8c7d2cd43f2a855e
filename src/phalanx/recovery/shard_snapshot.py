"""One rank's sharded training state as one flat byte buffer, and pieces read back from buffers.

A :class:`Snapshot` holds what a ZeRO rank alone holds, as the pieces
(:class:`~phalanx.sharding.pieces.Piece`) the checkpoint package writes, in two sections:

- ``"model"``: ZeRO-1/2: the parameter values of this rank's owned ranges (keyed
  ``param<i>``; every rank holds the full parameters, but a snapshot must be of *its* step,
  and the owned ranges of all ranks cover every parameter once); ZeRO-3: the flat parameter
  shards (``FullyShardedDataParallel.sharded_state``, keyed by the model's names);
- ``"optimizer"``: the optimizer state of the same elements (``sharded_state`` of the ZeRO
  optimizer, or of the plain optimizer over ZeRO-3's flat shards).

Taking one is a memcpy of every piece into one buffer (aligned, raw bytes, so any dtype comes
back bit-identical); the manifest (keys, ranges, dtypes, byte offsets, each section's ``meta``)
is plain data. :func:`readers` turns the snapshots of several old ranks into one in-memory
:class:`~phalanx.sharding.pieces.PieceReader` per section, which the objects' own
``load_sharded_state`` reads at any new world size, as from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.sharding.optimizer_pieces import optimizer_view
from phalanx.sharding.pieces import Piece, PieceReader, ShardedState, dtype_name
from phalanx.sharding.zero import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel

__all__ = ["ALIGN", "PARAMS_FORMAT", "Snapshot", "pack", "readers", "sections_of"]

ALIGN = 16  # every piece starts at a multiple of any element size: views need no copy
PARAMS_FORMAT = "phalanx.zero-params/1"
"""The ``"model"`` section of a ZeRO-1/2 snapshot: the owned ranges' parameter values."""


@dataclass
class Snapshot:
    """A rank's pieces at the end of optimizer step ``step``: ``buffer`` holds their bytes."""

    step: int
    manifest: dict[str, Any]
    """``kind``, ``metas`` (section -> meta) and ``pieces``: ``[section, key, shape, start,
    end, dtype, byte offset]`` each."""
    buffer: torch.Tensor
    """1-D uint8."""

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self.buffer.numel()


def _zero_params(opt: ZeroRedundancyOptimizer) -> ShardedState:
    """The parameter values of ``opt``'s owned ranges, one piece per range."""
    pieces = []
    for mine in opt.owned:
        for r in mine:
            p = r.piece
            value = p.of_full(opt.params[r.param].detach())
            pieces.append((Piece(p.key, p.shape, p.start, p.end), value))
    return ShardedState({"format": PARAMS_FORMAT, "params": len(opt.params)}, pieces)


def sections_of(
    optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel | None
) -> dict[str, ShardedState]:
    """This rank's ``"model"`` and ``"optimizer"`` pieces (views; :func:`pack` copies them)."""
    if model is not None:
        view = optimizer_view(model, optimizer)
        assert view is not None, "a ZeRO-3 model always has a sharded optimizer view"
        return {"model": model.sharded_state(), "optimizer": view.sharded_state()}
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return {"model": _zero_params(optimizer), "optimizer": optimizer.sharded_state()}


def pack(
    step: int, kind: str, sections: dict[str, ShardedState], reuse: torch.Tensor | None = None
) -> Snapshot:
    """Copy every piece of ``sections`` into one buffer (``reuse``'s when its size fits)."""
    entries: list[list[Any]] = []
    values: list[tuple[int, torch.Tensor]] = []
    at = 0
    for name, state in sections.items():
        for piece, t in state.pieces:
            at = -(-at // ALIGN) * ALIGN
            entry = [name, piece.key, list(piece.shape), piece.start, piece.end]
            entries.append([*entry, dtype_name(t.dtype), at])
            values.append((at, t))
            at += t.numel() * t.element_size()
    fits = reuse is not None and reuse.numel() == at
    buffer = reuse if reuse is not None and fits else torch.empty(at, dtype=torch.uint8)
    with torch.no_grad():
        for start, t in values:
            end = start + t.numel() * t.element_size()
            buffer[start:end].view(t.dtype).copy_(t.reshape(-1))
    metas = {name: state.meta for name, state in sections.items()}
    return Snapshot(step, {"kind": kind, "metas": metas, "pieces": entries}, buffer)


def _views(snap: Snapshot) -> dict[str, torch.Tensor]:
    """Each piece's elements in the buffer, by its position in the manifest."""
    out = {}
    for i, (_, _, _, start, end, dtype, at) in enumerate(snap.manifest["pieces"]):
        dt: torch.dtype = getattr(torch, dtype)
        nbytes = (end - start) * dt.itemsize
        out[str(i)] = snap.buffer[at : at + nbytes].view(dt)
    return out


def readers(snaps: Sequence[tuple[int, Snapshot]]) -> dict[str, tuple[dict[str, Any], PieceReader]]:
    """Per section: the lowest old rank's ``meta`` and a reader over every snapshot's pieces.

    Args:
        snaps: ``(old rank, snapshot)`` pairs, one snapshot per old rank, all of one step.
    """
    index: dict[str, list[tuple[Piece, str, str, str]]] = {}
    metas: dict[str, dict[str, Any]] = {}
    views: dict[str, dict[str, torch.Tensor]] = {}
    for rank, snap in sorted(snaps, key=lambda s: s[0]):
        source = str(rank)
        views[source] = _views(snap)
        for name, meta in snap.manifest["metas"].items():
            metas.setdefault(name, meta)
            index.setdefault(name, [])
        for i, (name, key, shape, start, end, dtype, _) in enumerate(snap.manifest["pieces"]):
            index[name].append((Piece(key, tuple(shape), start, end), dtype, source, str(i)))
    return {name: (metas[name], PieceReader(index[name], views.__getitem__)) for name in metas}
