"""A ``torch.optim`` optimizer's state as pieces, and back to a plain state dict.

Per-element state (``exp_avg``, ...) follows its parameter's pieces, keyed ``<name>/<state>``
(a parameter's name in the unsplit model) or ``param<i>/<state>`` (ZeRO-1/2, by global index).
:class:`PieceOptimizerState` cuts a plain optimizer's state along the pieces its parameters hold
(an optimizer over ZeRO-3 flat shards, or over a tensor-parallel / pipelined model's
parameters); :func:`full_optimizer_state` assembles a ``torch.optim`` state dict from any such
checkpoint, so a plain optimizer resumes from it. Scalars (Adam's ``step``) travel in ``meta``
here (:func:`encode_scalar`) or, for ZeRO-1/2, as one-element pieces.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from phalanx.sharding.pieces import (
    HeldPieces,
    Piece,
    PieceReader,
    ShardedState,
    dtype_name,
    param_key,
)

__all__ = [
    "FORMAT",
    "PieceOptimizerState",
    "decode_scalar",
    "encode_scalar",
    "full_optimizer_state",
    "optimizer_view",
    "state_keys",
]

FORMAT = "phalanx.zero3-optim/1"
ZERO_FORMAT_V1 = "phalanx.zero/1"
"""ZeRO-1/2's first format: every parameter had the same keys and scalars, kept in ``meta``."""
_ZERO_KEY = re.compile(r"^param(\d+)/(.+?)(:py|:none)?$")


def encode_scalar(key: str, v: Any) -> dict[str, Any]:
    """A JSON-able scalar state value (ZeRO-1/2 format 1 and plain-optimizer checkpoints)."""
    if isinstance(v, torch.Tensor):
        return {"value": v.item(), "dtype": dtype_name(v.dtype)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise TypeError(f"optimizer state {key!r} holds a {type(v).__name__}, which cannot be saved")


def decode_scalar(doc: dict[str, Any]) -> Any:
    """The value :func:`encode_scalar` encoded."""
    if "dtype" in doc:
        return torch.tensor(doc["value"], dtype=getattr(torch, doc["dtype"]))
    return doc["value"]


def meta_scalars(meta: dict[str, Any]) -> dict[str, Any]:
    """The scalars every parameter shares, for formats that keep them in ``meta``."""
    return {k: decode_scalar(v) for k, v in meta.get("scalars", {}).items()}


def state_keys(meta: dict[str, Any], reader: PieceReader, n: int) -> dict[int, dict[str, str]]:
    """Per parameter index: state name -> the saved key to read it from."""
    if meta.get("format") == ZERO_FORMAT_V1 or "param_keys" in meta:
        names = meta.get("param_keys") or [param_key(i) for i in range(n)]
        return {i: {k: f"{names[i]}/{k}" for k in meta["per_element"]} for i in range(n)}
    out: dict[int, dict[str, str]] = {}
    for saved in reader.keys():  # noqa: SIM118 (a PieceReader, not a dict)
        m = _ZERO_KEY.match(saved)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = saved
    return out


def read_value(reader: PieceReader, saved: str, start: int, end: int) -> Any:
    """Elements ``start:end`` of ``saved``, or the scalar it holds (``:py``, ``:none``)."""
    if saved.endswith(":none"):
        return None
    if reader.shape(saved) == ():
        value = reader.read(saved, 0, 1)
        return value.item() if saved.endswith(":py") else value.reshape(())
    return reader.read(saved, start, end)


def full_optimizer_state(
    meta: dict[str, Any], reader: PieceReader, names: list[str] | None = None
) -> dict[str, Any]:
    """A ``torch.optim`` state dict assembled from an optimizer's pieces (any world size).

    Works for ZeRO-1/2 optimizers and for optimizers whose pieces are keyed by parameter name
    (ZeRO-3 shards, a split model): a plain optimizer over the unwrapped model's
    ``parameters()`` loads it, given that model's parameter ``names`` in order.
    """
    if "num_params" not in meta or "param_groups" not in meta:
        raise ValueError(f"not a ZeRO optimizer checkpoint (format {meta.get('format')!r})")
    n = int(meta["num_params"])
    if meta.get("param_keys") and names is not None:
        if sorted(names) != sorted(meta["param_keys"]):
            raise ValueError(
                f"the checkpoint's optimizer covers parameters {sorted(meta['param_keys'])}, "
                f"the model has {sorted(names)}"
            )
        meta = {**meta, "param_keys": names}
    state: dict[int, dict[str, Any]] = {}
    for i, keys in sorted(state_keys(meta, reader, n).items()):
        st = meta_scalars(meta)
        for k, saved in keys.items():
            whole = reader.shape(saved) != ()
            st[k] = reader.full(saved) if whole else read_value(reader, saved, 0, 1)
        state[i] = st
    return {"state": state, "param_groups": meta["param_groups"]}


def optimizer_view(model: Any, optimizer: Any) -> PieceOptimizerState | None:
    """A sharded view of ``optimizer`` when ``model`` shards its parameters (ZeRO-3), else None."""
    layout = getattr(model, "shard_layout", None)
    if optimizer is None or not callable(layout):
        return None
    names = [e.keys[0] for u in getattr(model, "units", []) for e in u.entries]
    saves = getattr(model, "replica_index", 0) == 0  # hybrid sharding: replica 0 writes
    return PieceOptimizerState(optimizer, layout(), names, saves=saves)


class PieceOptimizerState:
    """Implements :class:`~phalanx.sharding.pieces.Sharded` for a plain optimizer whose
    parameters hold known pieces (``layout``: each parameter, flattened, with its pieces)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: HeldPieces,
        names: list[str] | None = None,
        *,
        saves: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.layout = layout
        self.saves = saves
        """Whether :meth:`sharded_state` gives pieces (False: a hybrid replica other than the
        first, whose shards equal the first's; it still loads its own)."""
        self.keys = names or [piece.key for _, pieces in layout for piece in pieces]
        """Every parameter's name (all ranks' shards), to assemble a plain optimizer's state."""

    def _groups(self) -> list[dict[str, Any]]:
        options = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return [{**options, "params": list(range(len(self.keys)))}]

    def sharded_state(self) -> ShardedState:
        pieces: list[tuple[Piece, torch.Tensor]] = []
        scalars: dict[str, Any] = {}
        per_element: set[str] = set()
        for flat, held in self.layout:
            for k, v in self.optimizer.state.get(flat, {}).items():
                if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                    scalars[k] = encode_scalar(k, v)
                    continue
                per_element.add(k)
                v = v.reshape(-1)  # flat shards are 1-D already; whole parameters are not
                if self.saves:
                    pieces += [(p.of_state(k), p.held_in(v)) for p in held]
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
        for flat, held in self.layout:
            state: dict[str, Any] = meta_scalars(meta)
            for k in meta["per_element"]:
                t = torch.zeros(flat.numel(), dtype=flat.dtype, device=flat.device)
                for p in held:
                    reader.read(p.of_state(k).key, p.start, p.end, out=p.held_in(t))
                state[k] = t.view_as(flat)
            if held:
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
