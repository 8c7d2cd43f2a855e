"""State of a ZeRO-1/2 optimizer as world-size-independent pieces (``phalanx.checkpoint``).

Each rank writes the state of its owned ranges as pieces keyed ``param<i>/<state>`` with the
element range they cover, so a checkpoint written by N ranks loads at any M: a rank reads the
ranges its own layout needs. Scalars (Adam's ``step``) are one-element pieces of shape ``()``
written by the owner of the parameter's first element; a parameter without state (never
stepped) has no pieces. A Python number is saved under ``param<i>/<state>:py`` and ``None``
under ``param<i>/<state>:none``.

Format ``phalanx.zero/1`` (written before parameters without gradients were skipped: every
parameter had the same keys and scalars, kept in ``meta``) is still read.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.sharding.optimizer_pieces import (
    ZERO_FORMAT_V1,
    meta_scalars,
    read_value,
    state_keys,
)
from phalanx.sharding.owned import OwnedRange
from phalanx.sharding.pieces import Piece, PieceReader, ShardedState
from phalanx.sharding.zero_state import (
    ZeroShards,
    groups_meta,
    install,
    set_hyperparameters,
    stepped_ranges,
)

__all__ = ["FORMAT", "load_sharded_state", "sharded_state"]

FORMAT = "phalanx.zero/2"


def _scalar_piece(r: OwnedRange, k: str, v: Any) -> tuple[Piece, torch.Tensor]:
    key = r.piece.of_state(k).key
    if isinstance(v, torch.Tensor):
        return Piece(key, (), 0, 1), v.detach().reshape(1)
    if v is None:
        return Piece(f"{key}:none", (), 0, 1), torch.zeros(1, dtype=torch.bool)
    if isinstance(v, (bool, int, float)):
        return Piece(f"{key}:py", (), 0, 1), torch.tensor([v])
    raise TypeError(
        f"optimizer state {k!r} of parameter {r.param} holds a {type(v).__name__}, "
        f"which cannot be saved"
    )


def sharded_state(opt: ZeroShards, writes: bool = True) -> ShardedState:
    """This rank's pieces (none unless ``writes``: a hybrid replica other than the first)."""
    pieces: list[tuple[Piece, torch.Tensor]] = []
    for r, elems, scalars in stepped_ranges(opt) if writes else []:
        pieces += [(r.piece.of_state(k), t.detach().reshape(-1)) for k, t in sorted(elems.items())]
        if r.piece.start == 0:
            pieces += [_scalar_piece(r, k, v) for k, v in sorted(scalars.items())]
    meta = {"format": FORMAT, "num_params": len(opt.params), "param_groups": groups_meta(opt)}
    return ShardedState(meta, pieces)


def load_sharded_state(opt: ZeroShards, meta: dict[str, Any], reader: PieceReader) -> None:
    where = "load_sharded_state"
    if meta.get("format") not in (FORMAT, ZERO_FORMAT_V1):
        raise ValueError(
            f"{where}: not a ZeRO optimizer checkpoint (format {meta.get('format')!r})"
        )
    set_hyperparameters(opt, meta["param_groups"], where)
    keys = state_keys(meta, reader, len(opt.params))
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for mine in opt.owned:
        for r in mine:
            if r.param not in keys:
                continue
            st = meta_scalars(meta)
            for k, saved in keys[r.param].items():
                st[k] = read_value(reader, saved, r.piece.start, r.piece.end)
                if isinstance(st[k], torch.Tensor) and st[k].dim() > 0:
                    st[k] = st[k].view(r.tensor.shape)
            states.append((r.tensor, st))
    install(opt, states)
