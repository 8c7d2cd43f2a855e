"""The state of a plain ``torch.optim`` optimizer over ZeRO-3 flat shards, as pieces.

Under :class:`~phalanx.sharding.zero3.FullyShardedDataParallel` the user's optimizer steps one
1-D shard per unit, so its per-element state (``exp_avg``, ...) is shard-shaped. The model's
``shard_layout()`` says which elements of which original parameter each shard holds; this view
cuts the state along it into pieces keyed ``<parameter name>/<state>`` — the form
``phalanx.checkpoint`` writes per rank and reads back at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.sharding.state import Piece, PieceReader, ShardedState
from phalanx.sharding.zero_pieces import decode_scalar, encode_scalar

__all__ = ["FORMAT", "ShardedOptimizerState", "optimizer_view"]

FORMAT = "phalanx.zero3-optim/1"

Layout = list[tuple[nn.Parameter, list[tuple[str, tuple[int, ...], int, int, int]]]]


def optimizer_view(model: Any, optimizer: Any) -> ShardedOptimizerState | None:
    """A sharded view of ``optimizer`` when ``model`` shards its parameters (ZeRO-3), else None."""
    layout = getattr(model, "shard_layout", None)
    if optimizer is None or not callable(layout):
        return None
    names = [e.keys[0] for u in getattr(model, "units", []) for e in u.entries]
    return ShardedOptimizerState(optimizer, layout(), names)


class ShardedOptimizerState:
    """Implements :class:`~phalanx.sharding.Sharded` for an optimizer over flat shards."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, layout: Layout, names: list[str] | None = None
    ) -> None:
        self.optimizer = optimizer
        self.layout = layout
        self.keys = names or [key for _, segs in layout for key, *_ in segs]
        """Every parameter's name (all ranks' shards), to assemble a plain optimizer's state."""

    def _groups(self) -> list[dict[str, Any]]:
        options = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return [{**options, "params": list(range(len(self.keys)))}]

    def sharded_state(self) -> ShardedState:
        pieces: list[tuple[Piece, torch.Tensor]] = []
        scalars: dict[str, Any] = {}
        per_element: set[str] = set()
        for flat, segs in self.layout:
            for k, v in self.optimizer.state.get(flat, {}).items():
                if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                    scalars[k] = encode_scalar(k, v)
                    continue
                per_element.add(k)
                v = v.reshape(-1)  # flat shards are 1-D already; whole parameters are not
                dtype = str(v.dtype).removeprefix("torch.")
                for key, shape, start, end, off in segs:
                    piece = Piece(f"{key}/{k}", tuple(shape), start, end, dtype)
                    pieces.append((piece, v[off : off + end - start]))
        meta = {
            "format": FORMAT,
            "num_params": len(self.keys),
            "param_keys": self.keys,
            "param_groups": self._groups(),
            "per_element": sorted(per_element),
            "scalars": scalars,
        }
        return ShardedState(meta, pieces)

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"the checkpoint's optimizer state has format {meta.get('format')!r}; a ZeRO-3 "
                f"optimizer loads only {FORMAT!r} (saved under FullyShardedDataParallel)"
            )
        options = {k: v for k, v in meta["param_groups"][0].items() if k != "params"}
        for group in self.optimizer.param_groups:
            group.update(options)
        for flat, segs in self.layout:
            state: dict[str, Any] = {k: decode_scalar(v) for k, v in meta["scalars"].items()}
            for k in meta["per_element"]:
                t = torch.zeros(flat.numel(), dtype=flat.dtype, device=flat.device)
                for key, _, start, end, off in segs:
                    reader.read(f"{key}/{k}", start, end, out=t[off : off + end - start])
                state[k] = t.view_as(flat)
            if segs:
                self.optimizer.state[flat] = state

    def state_dict(self) -> dict[str, Any]:
        raise ValueError(
            "the optimizer of a ZeRO-3 model has no replicated state dict; save it with "
            "phalanx.checkpoint.save(model=..., optimizer=...), which writes per-rank pieces"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ValueError(
            "this checkpoint holds a replicated (non-ZeRO-3) optimizer state, which cannot be "
            "resharded into a ZeRO-3 optimizer; load it with the strategy that saved it"
        )
