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

import re
from typing import TYPE_CHECKING, Any

import torch

from phalanx.sharding.state import Piece, PieceReader, ShardedState
from phalanx.sharding.zero_state import groups_meta, install, set_hyperparameters, split_state

if TYPE_CHECKING:
    from phalanx.sharding.zero import ZeroRedundancyOptimizer

__all__ = [
    "FORMAT",
    "decode_scalar",
    "encode_scalar",
    "full_from_pieces",
    "load_sharded_state",
    "sharded_state",
]

FORMAT = "phalanx.zero/2"
FORMAT_V1 = "phalanx.zero/1"
_KEY = re.compile(r"^param(\d+)/(.+?)(:py|:none)?$")


def encode_scalar(key: str, v: Any) -> dict[str, Any]:
    """A JSON-able scalar state value (format 1 and ZeRO-3 optimizer checkpoints)."""
    if isinstance(v, torch.Tensor):
        return {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise TypeError(f"optimizer state {key!r} holds a {type(v).__name__}, which cannot be saved")


def decode_scalar(doc: dict[str, Any]) -> Any:
    """The value :func:`encode_scalar` encoded."""
    if "dtype" in doc:
        return torch.tensor(doc["value"], dtype=getattr(torch, doc["dtype"]))
    return doc["value"]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _scalar_piece(i: int, k: str, v: Any) -> tuple[Piece, torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return Piece(f"param{i}/{k}", (), 0, 1, _dtype(v)), v.detach().reshape(1)
    if v is None:
        return Piece(f"param{i}/{k}:none", (), 0, 1, "bool"), torch.zeros(1, dtype=torch.bool)
    if isinstance(v, (bool, int, float)):
        t = torch.tensor([v])
        return Piece(f"param{i}/{k}:py", (), 0, 1, _dtype(t)), t
    raise TypeError(
        f"optimizer state {k!r} of parameter {i} holds a {type(v).__name__}, which cannot be saved"
    )


def sharded_state(opt: ZeroRedundancyOptimizer) -> ShardedState:
    pieces: list[tuple[Piece, torch.Tensor]] = []
    for mine in opt.owned:
        for r in mine:
            state = opt.optim.state.get(r.tensor)
            if not state:
                continue
            elems, scalars = split_state(state, r)
            shape = tuple(opt.params[r.param].shape)
            for k, t in sorted(elems.items()):
                piece = Piece(f"param{r.param}/{k}", shape, r.start, r.start + r.length, _dtype(t))
                pieces.append((piece, t.detach().reshape(-1)))
            if r.start == 0:
                pieces += [_scalar_piece(r.param, k, v) for k, v in sorted(scalars.items())]
    meta = {"format": FORMAT, "num_params": len(opt.params), "param_groups": groups_meta(opt)}
    return ShardedState(meta, pieces)


def _keys(meta: dict[str, Any], reader: PieceReader, n: int) -> dict[int, dict[str, str]]:
    """Per parameter: state key -> the saved key to read it from."""
    if meta.get("format") == FORMAT_V1 or "param_keys" in meta:
        names = meta.get("param_keys") or [f"param{i}" for i in range(n)]
        return {i: {k: f"{names[i]}/{k}" for k in meta["per_element"]} for i in range(n)}
    out: dict[int, dict[str, str]] = {}
    for saved in reader.keys():  # noqa: SIM118 (a PieceReader, not a dict)
        m = _KEY.match(saved)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = saved
    return out


def _read(reader: PieceReader, saved: str, start: int, end: int) -> Any:
    if saved.endswith(":none"):
        return None
    if reader.shape(saved) == ():
        value = reader.read(saved, 0, 1)
        return value.item() if saved.endswith(":py") else value.reshape(())
    return reader.read(saved, start, end)


def _v1_scalars(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: decode_scalar(v) for k, v in meta.get("scalars", {}).items()}


def load_sharded_state(
    opt: ZeroRedundancyOptimizer, meta: dict[str, Any], reader: PieceReader
) -> None:
    where = "load_sharded_state"
    if meta.get("format") not in (FORMAT, FORMAT_V1):
        raise ValueError(
            f"{where}: not a ZeRO optimizer checkpoint (format {meta.get('format')!r})"
        )
    set_hyperparameters(opt, meta["param_groups"], where)
    keys = _keys(meta, reader, len(opt.params))
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for mine in opt.owned:
        for r in mine:
            if r.param not in keys:
                continue
            st = {**_v1_scalars(meta)}
            for k, saved in keys[r.param].items():
                st[k] = _read(reader, saved, r.start, r.start + r.length)
                if isinstance(st[k], torch.Tensor) and st[k].dim() > 0:
                    st[k] = st[k].view(r.tensor.shape)
            states.append((r.tensor, st))
    install(opt, states)


def full_from_pieces(
    meta: dict[str, Any], reader: PieceReader, names: list[str] | None = None
) -> dict[str, Any]:
    """A ``torch.optim`` state dict assembled from a ZeRO checkpoint's pieces (any world size).

    Works for ZeRO-1/2 optimizers and for optimizers over ZeRO-3 shards (whose pieces are keyed
    by parameter name): a plain optimizer over the unwrapped model's ``parameters()`` loads
    it, given that model's parameter ``names`` in order.
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
    for i, keys in sorted(_keys(meta, reader, n).items()):
        st = {**_v1_scalars(meta)}
        for k, saved in keys.items():
            st[k] = reader.full(saved) if reader.shape(saved) != () else _read(reader, saved, 0, 1)
        state[i] = st
    return {"state": state, "param_groups": meta["param_groups"]}
