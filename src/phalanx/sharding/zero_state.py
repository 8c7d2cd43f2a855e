"""State of a ZeRO-1/2 optimizer: full ``torch.optim`` format, and world-size-independent pieces.

Per-element state (``exp_avg``, ``momentum_buffer``, ...) lives as one tensor per bucket shard.
Both formats cut it along the layout's segments into per-parameter ranges: the full format
gathers every rank's ranges into whole tensors shaped like the parameters (keyed by global
parameter index, as ``torch.optim`` numbers them); the piece format keys each range as
``param<i>/<state>`` so a checkpoint written by N ranks loads at any M. Scalar state (Adam's
``step``) is equal on every shard and travels in ``meta``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.comm import collectives as c
from phalanx.sharding.state import Piece, PieceReader, ShardedState

if TYPE_CHECKING:
    from phalanx.sharding.zero import ZeroRedundancyOptimizer

__all__ = [
    "decode_scalar",
    "encode_scalar",
    "full_from_pieces",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_state",
    "sharded_state",
]

FORMAT = "phalanx.zero/1"


def _own_segments(opt: ZeroRedundancyOptimizer, b: int) -> list[tuple[int, int, int, int]]:
    """``(param, param_start, length, offset in this rank's shard)`` of bucket ``b``."""
    bucket = opt.layout.buckets[b]
    base = opt.rank * bucket.chunk
    return [
        (s.param, s.param_start, s.length, s.staging - base)
        for s in bucket.segments
        if s.rank == opt.rank
    ]


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    per_element = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return per_element, {k: v for k, v in state.items() if k not in per_element}


def encode_scalar(key: str, v: Any) -> dict[str, Any]:
    if isinstance(v, torch.Tensor):
        return {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise TypeError(f"optimizer state {key!r} holds a {type(v).__name__}, which cannot be saved")


def decode_scalar(doc: dict[str, Any]) -> Any:
    if "dtype" in doc:
        return torch.tensor(doc["value"], dtype=getattr(torch, doc["dtype"]))
    return doc["value"]


def _groups_meta(opt: ZeroRedundancyOptimizer) -> list[dict[str, Any]]:
    out, first = [], 0
    for g, n in zip(opt.param_groups, _group_param_counts(opt)):
        options = {k: v for k, v in g.items() if k != "params"}
        out.append({**options, "params": list(range(first, first + n))})
        first += n
    return out


def _group_param_counts(opt: ZeroRedundancyOptimizer) -> list[int]:
    counts = [0] * len(opt.param_groups)
    for b in opt.layout.buckets:
        counts[b.group] += len(b.params)
    return counts


def _set_hyperparameters(
    opt: ZeroRedundancyOptimizer, groups: list[dict[str, Any]], where: str
) -> None:
    counts = _group_param_counts(opt)
    saved = [len(g["params"]) for g in groups]
    if saved != counts:
        raise ValueError(
            f"{where}: saved parameter groups hold {saved} parameters, this optimizer's hold "
            f"{counts}; build the optimizer over the same model and groups"
        )
    for g, doc in zip(opt.param_groups, groups):
        g.update({k: v for k, v in doc.items() if k != "params"})


# ---- pieces (phalanx.checkpoint) -----------------------------------------------------------------
def sharded_state(opt: ZeroRedundancyOptimizer) -> ShardedState:
    pieces: list[tuple[Piece, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    keys: set[str] = set()
    for b, shard in enumerate(opt.shards):
        per_element, rest = _split(opt.optim.state.get(shard, {}))
        scalars.update({k: encode_scalar(k, v) for k, v in rest.items()})
        keys.update(per_element)
        for k, t in per_element.items():
            for param, start, length, off in _own_segments(opt, b):
                shape = tuple(opt.params[param].shape)
                dtype = str(t.dtype).removeprefix("torch.")
                piece = Piece(f"param{param}/{k}", shape, start, start + length, dtype)
                pieces.append((piece, t[off : off + length]))
    meta = {
        "format": FORMAT,
        "num_params": len(opt.params),
        "param_groups": _groups_meta(opt),
        "per_element": sorted(keys),
        "scalars": scalars,
    }
    return ShardedState(meta, pieces)


def load_sharded_state(
    opt: ZeroRedundancyOptimizer, meta: dict[str, Any], reader: PieceReader
) -> None:
    where = "load_sharded_state"
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{where}: not a ZeRO optimizer checkpoint (format {meta.get('format')!r})"
        )
    _set_hyperparameters(opt, meta["param_groups"], where)
    for b, shard in enumerate(opt.shards):
        state: dict[str, Any] = {k: decode_scalar(v) for k, v in meta["scalars"].items()}
        for k in meta["per_element"]:
            t = torch.zeros(
                shard.numel(),
                dtype=reader.dtype(f"param{opt.layout.buckets[b].params[0]}/{k}"),
                device=shard.device,
            )
            for param, start, length, off in _own_segments(opt, b):
                reader.read(f"param{param}/{k}", start, start + length, out=t[off : off + length])
            state[k] = t
        opt.optim.state[shard] = state


def full_from_pieces(
    meta: dict[str, Any], reader: PieceReader, names: list[str] | None = None
) -> dict[str, Any]:
    """A ``torch.optim`` state dict assembled from a ZeRO checkpoint's pieces (any world size).

    Works for ZeRO-1/2 optimizers and for optimizers over ZeRO-3 shards (whose pieces are keyed
    by parameter name): a plain optimizer over the unwrapped model's ``parameters()`` loads
    it, given that model's parameter ``names`` in order.
    """
    if "num_params" not in meta or "per_element" not in meta:
        raise ValueError(f"not a ZeRO optimizer checkpoint (format {meta.get('format')!r})")
    n = int(meta["num_params"])
    keys = meta.get("param_keys") or [f"param{i}" for i in range(n)]
    if meta.get("param_keys") and names is not None:
        if sorted(names) != sorted(keys):
            raise ValueError(
                f"the checkpoint's optimizer covers parameters {sorted(keys)}, the model has "
                f"{sorted(names)}"
            )
        keys = names
    state: dict[int, dict[str, Any]] = {}
    for i in range(n):
        st = {k: decode_scalar(v) for k, v in meta["scalars"].items()}
        for k in meta["per_element"]:
            st[k] = reader.full(f"{keys[i]}/{k}")
        state[i] = st
    return {"state": state, "param_groups": meta["param_groups"]}


# ---- full torch.optim format ---------------------------------------------------------------------
def full_state_dict(opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for bucket, shard in zip(opt.layout.buckets, opt.shards):
        per_element, rest = _split(opt.optim.state.get(shard, {}))
        for i in bucket.params:
            state[i] = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in rest.items()
            }
        for k in sorted(per_element):
            t = per_element[k]
            staging = torch.zeros(bucket.chunk * opt.world, dtype=t.dtype, device=t.device)
            mine = staging[opt.rank * bucket.chunk : (opt.rank + 1) * bucket.chunk]
            mine[: t.numel()].copy_(t)
            c.all_gather_into_tensor(staging, mine.clone(), group=opt.process_group)
            for i in bucket.params:
                state[i][k] = torch.zeros_like(opt.params[i], dtype=t.dtype)
            for s in bucket.segments:
                full = state[s.param][k].view(-1)
                full[s.param_start : s.param_start + s.length].copy_(
                    staging[s.staging : s.staging + s.length]
                )
    if all(not v for v in state.values()):
        state = {}
    return {"state": dict(sorted(state.items())), "param_groups": _groups_meta(opt)}


def load_full_state_dict(opt: ZeroRedundancyOptimizer, sd: dict[str, Any]) -> None:
    where = "load_state_dict"
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(
            f"{where}: expected a torch.optim state dict with 'state' and 'param_groups'"
        )
    _set_hyperparameters(opt, sd["param_groups"], where)
    saved = {int(k): v for k, v in sd["state"].items()}
    for b, (bucket, shard) in enumerate(zip(opt.layout.buckets, opt.shards)):
        present = [saved[i] for i in bucket.params if i in saved]
        if not present:
            opt.optim.state.pop(shard, None)
            continue
        state: dict[str, Any] = {}
        for k, v in present[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                t = torch.zeros(shard.numel(), dtype=v.dtype, device=shard.device)
                for param, start, length, off in _own_segments(opt, b):
                    if param in saved:
                        src = saved[param][k].reshape(-1)[start : start + length]
                        t[off : off + length].copy_(src)
                state[k] = t
            else:
                state[k] = v.clone() if isinstance(v, torch.Tensor) else v
        opt.optim.state[shard] = state
