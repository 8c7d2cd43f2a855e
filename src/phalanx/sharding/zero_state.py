"""State of a ZeRO-1/2 optimizer in ``torch.optim`` format: consolidate on one rank, load anywhere.

Each owned range (:mod:`phalanx.sharding.owned`) has its own inner-optimizer state: per-element
tensors shaped like the range (``exp_avg``, ``momentum_buffer``, ...) and scalars (Adam's
``step``). :func:`consolidate` gathers every rank's ranges into whole tensors shaped like the
parameters on one rank, keyed by global parameter index as ``torch.optim`` numbers them, as
torch's ``consolidate_state_dict(to=)`` does; :func:`load_full_state_dict` cuts such a dict
(from this class at any world size, or from a plain optimizer) into this rank's ranges. A
parameter that was never stepped has no entry, as in ``torch.optim``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.objects import all_gather_object
from phalanx.sharding.layout import ShardLayout
from phalanx.sharding.owned import OwnedRange
from phalanx.sharding.pieces import dtype_name

__all__ = [
    "ZeroShards",
    "check_full_state",
    "consolidate",
    "groups_meta",
    "install",
    "load_full_state_dict",
    "set_hyperparameters",
    "split_state",
    "stepped_ranges",
]


class ZeroShards(Protocol):
    """What these functions use of a :class:`~phalanx.sharding.ZeroRedundancyOptimizer`
    (declared here, so this module does not import the optimizer's)."""

    params: list[torch.Tensor]
    param_groups: list[dict[str, Any]]
    optim: torch.optim.Optimizer
    """The inner optimizer, over this rank's ranges."""
    state: defaultdict[torch.Tensor, Any]
    owned: list[list[OwnedRange]]
    layout: ShardLayout
    world: int
    rank: int
    process_group: dist.ProcessGroup | None


def split_state(state: dict[str, Any], r: OwnedRange) -> tuple[dict[str, torch.Tensor], dict]:
    """``(per-element tensors, scalars)`` of one range's state."""
    elems, scalars = {}, {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.shape != r.tensor.shape:
                raise ValueError(
                    f"optimizer state {k!r} of parameter {r.param} has shape {tuple(v.shape)}, "
                    f"neither a scalar nor the shape of what this rank steps "
                    f"{tuple(r.tensor.shape)}: it cannot be sharded"
                )
            elems[k] = v
        else:
            scalars[k] = v
    return elems, scalars


def stepped_ranges(
    opt: ZeroShards,
) -> Iterator[tuple[OwnedRange, dict[str, torch.Tensor], dict[str, Any]]]:
    """Each owned range that has state (was stepped), with its :func:`split_state`."""
    for mine in opt.owned:
        for r in mine:
            state = opt.optim.state.get(r.tensor)
            if state:
                yield (r, *split_state(state, r))


def groups_meta(opt: ZeroShards) -> list[dict[str, Any]]:
    """The parameter groups as ``torch.optim`` saves them: options and global indices."""
    out, first = [], 0
    for g in opt.param_groups:
        options = {k: v for k, v in g.items() if k != "params"}
        out.append({**options, "params": list(range(first, first + len(g["params"])))})
        first += len(g["params"])
    return out


def set_hyperparameters(opt: ZeroShards, groups: list[dict[str, Any]], where: str) -> None:
    """Take the saved groups' options, after checking they describe the same parameters."""
    saved = [len(g["params"]) for g in groups]
    here = [len(g["params"]) for g in opt.param_groups]
    if saved != here:
        raise ValueError(
            f"{where}: saved parameter groups hold {saved} parameters, this optimizer's hold "
            f"{here}; build the optimizer over the same model and groups"
        )
    for g, doc in zip(opt.param_groups, groups):
        g.update({k: v for k, v in doc.items() if k != "params"})
    for g, inner in zip(opt.param_groups, opt.optim.param_groups):
        inner.update({k: v for k, v in g.items() if k != "params"})


def install(opt: ZeroShards, states: list[tuple[torch.Tensor, dict]]) -> None:
    """Replace the inner optimizer's state by ``states`` (through its own ``load_state_dict``,
    which casts each value as ``torch.optim`` does: ``step`` stays, the rest follows the
    parameter's dtype and device)."""
    tensors = [t for g in opt.optim.param_groups for t in g["params"]]
    index = {id(t): i for i, t in enumerate(tensors)}
    groups, first = [], 0
    for g in opt.optim.param_groups:
        options = {k: v for k, v in g.items() if k != "params"}
        groups.append({**options, "params": list(range(first, first + len(g["params"])))})
        first += len(g["params"])
    opt.optim.load_state_dict(
        {"state": {index[id(t)]: st for t, st in states}, "param_groups": groups}
    )
    opt.state = opt.optim.state  # load_state_dict replaced the inner optimizer's mapping


# ---- consolidate -------------------------------------------------------------------------------
def _describe(opt: ZeroShards) -> dict[str, Any]:
    """This rank's state keys: per parameter, the per-element dtypes and the scalar values."""
    out: dict[str, Any] = {}
    for r, elems, scalars in stepped_ranges(opt):
        doc = out.setdefault(str(r.param), {"elems": {}, "scalars": {}})
        doc["elems"].update({k: dtype_name(v.dtype) for k, v in elems.items()})
        if r.piece.start == 0 or not doc["scalars"]:
            doc["scalars"] = dict(scalars)
    return out


def _gather_chunks(
    opt: ZeroShards, b: int, key: str, dtype: torch.dtype, to: int
) -> list[torch.Tensor] | None:
    """Every rank's chunk of ``key`` for bucket ``b``, on rank ``to`` (None elsewhere)."""
    bucket = opt.layout.buckets[b]
    mine = torch.zeros(bucket.chunk, dtype=dtype, device=opt.params[0].device)
    for r in opt.owned[b]:
        state = opt.optim.state.get(r.tensor, {})
        if key in state:
            r.piece.held_in(mine).copy_(state[key].reshape(-1))
    if opt.world == 1:
        return [mine]
    out = [torch.empty_like(mine) for _ in range(opt.world)] if opt.rank == to else None
    dst = dist.get_global_rank(opt.process_group, to) if opt.process_group else to
    c.gather(mine, out, dst, opt.process_group)
    return out


def consolidate(opt: ZeroShards, to: int) -> dict[int, dict[str, Any]] | None:
    """Every parameter's state, whole, on group rank ``to``; None on the other ranks."""
    if not 0 <= to < opt.world:
        raise ValueError(
            f"consolidate_state_dict: to={to} is not a rank of the group (0..{opt.world - 1})"
        )
    descs = [_describe(opt)]
    if opt.world > 1:
        descs = [None] * opt.world  # type: ignore[list-item]
        all_gather_object(descs, _describe(opt), opt.process_group)
    merged: dict[int, dict[str, Any]] = {}
    for desc in descs:
        for i, doc in desc.items():
            into = merged.setdefault(int(i), {"elems": {}, "scalars": {}})
            into["elems"].update(doc["elems"])
            into["scalars"] = into["scalars"] or doc["scalars"]
    full: dict[int, dict[str, Any]] = {i: dict(doc["scalars"]) for i, doc in merged.items()}
    for b, bucket in enumerate(opt.layout.buckets):
        keys = {
            (k, d) for i in bucket.params for k, d in merged.get(i, {"elems": {}})["elems"].items()
        }
        for key, dtype in sorted(keys):
            chunks = _gather_chunks(opt, b, key, getattr(torch, dtype), to)
            if chunks is None:
                continue
            for seg in bucket.segments:
                if key not in merged.get(seg.param, {"elems": {}})["elems"]:
                    continue
                p = opt.params[seg.param]
                t = full[seg.param].setdefault(key, torch.zeros(p.shape, dtype=chunks[0].dtype))
                at = seg.piece.offset - seg.rank * bucket.chunk  # into the rank's chunk
                seg.piece.of_full(t).copy_(chunks[seg.rank][at : at + seg.piece.numel])
    return dict(sorted(full.items())) if opt.rank == to else None


# ---- load --------------------------------------------------------------------------------------
def _cut(value: Any, r: OwnedRange, p: torch.Tensor, key: str) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value.clone()
    if value.numel() != p.numel():
        raise ValueError(
            f"load_state_dict: state {key!r} of parameter {r.param} has shape "
            f"{tuple(value.shape)}, the parameter {tuple(p.shape)}"
        )
    return r.view_of(value.reshape(p.shape)).clone()


def load_full_state_dict(opt: ZeroShards, sd: dict[str, Any]) -> None:
    """Keep this rank's ranges of a ``torch.optim``-format state dict."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(
            "load_state_dict: expected a torch.optim state dict with 'state' and 'param_groups'"
        )
    set_hyperparameters(opt, sd["param_groups"], "load_state_dict")
    saved = {int(k): v for k, v in sd["state"].items() if v is not None}
    states = []
    for mine in opt.owned:
        for r in mine:
            if r.param in saved:
                p = opt.params[r.param]
                st = {k: _cut(v, r, p, k) for k, v in saved[r.param].items()}
                states.append((r.tensor, st))
    install(opt, states)


def check_full_state(opt: ZeroShards, sd: Any) -> None:
    """Refuse a ``regroup`` ``full_state`` that is not this model's optimizer state, before
    anything changes (None passes: the state starts empty)."""
    if sd is None:
        return
    where = "ZeroRedundancyOptimizer.regroup"
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise TypeError(
            f"{where}: full_state must be a torch.optim state dict with 'state' and "
            f"'param_groups' (as state_dict() gives after consolidate_state_dict), got "
            f"{type(sd).__name__}"
            + (f" with keys {sorted(map(str, sd))}" if isinstance(sd, dict) else "")
        )
    saved = [len(g["params"]) for g in sd["param_groups"]]
    here = [len(g["params"]) for g in opt.param_groups]
    if saved != here:
        raise ValueError(
            f"{where}: full_state is of another model: its parameter groups hold {saved} "
            f"parameters, this optimizer's hold {here}"
        )
    for i, state in sd["state"].items():
        if not 0 <= int(i) < len(opt.params):
            raise ValueError(
                f"{where}: full_state is of another model: it has state for parameter {i}, "
                f"this optimizer has {len(opt.params)} parameters"
            )
        p = opt.params[int(i)]
        for k, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != p.numel():
                raise ValueError(
                    f"{where}: full_state is of another model: its state {k!r} of parameter "
                    f"{i} has shape {tuple(v.shape)}, the parameter {tuple(p.shape)}"
                )
