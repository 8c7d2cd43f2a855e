"""The state of an optimizer built over ZeRO-3's flat shards, whole, in ``torch.optim`` format.

A ``torch.optim`` optimizer over ``FullyShardedDataParallel.parameters()`` keeps, per unit,
state shaped like this rank's flat shard (``exp_avg``, ...) plus scalars (Adam's ``step``).
:func:`full_optim_state_dict` all-gathers each per-element state like the parameters and cuts
it into the original parameters, numbered as :func:`param_names` lists them (each unit's
parameters in order, the root unit last); :func:`load_full_optim_state_dict` cuts such a dict
back into this rank's shards at any world size, through the optimizer's own
``load_state_dict`` (so the optimizer stays the same object). A unit without state (never
stepped) has no entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from phalanx.sharding.zero3.state_dict import gather_flat_tensor
from phalanx.sharding.zero3.unit import FlatUnit

__all__ = ["check_full_optim_state", "full_optim_state_dict", "load_full_optim_state_dict"]


def param_names(units: Sequence[FlatUnit]) -> list[str]:
    """Every original parameter's canonical key, in the full state's numbering."""
    return [e.keys[0] for u in units for e in u.entries]


def _per_element(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0


def _flat_index(optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit]) -> dict[int, int]:
    """Position of each unit's flat shard in the optimizer's parameters (units it steps)."""
    mine = {id(t): i for i, t in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {u_i: mine[id(u.flat_param)] for u_i, u in enumerate(units) if id(u.flat_param) in mine}


def _groups(optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit]) -> list[list[int]]:
    """Each optimizer group's original parameters, by full-state number."""
    first, starts = 0, {}
    for u in units:
        starts[id(u.flat_param)] = range(first, first + len(u.entries))
        first += len(u.entries)
    return [[i for p in g["params"] for i in starts.get(id(p), ())] for g in optimizer.param_groups]


def full_optim_state_dict(
    optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit]
) -> dict[str, Any]:
    """The whole optimizer state on every rank (a collective: every rank calls it)."""
    state: dict[int, dict[str, Any]] = {}
    first = 0
    for u in units:
        st = optimizer.state.get(u.flat_param, {})
        for k in sorted(st):
            v = st[k]
            whole = gather_flat_tensor(u, v) if _per_element(v) else None
            for i, e in enumerate(u.entries):
                doc = state.setdefault(first + i, {})
                if whole is None:
                    doc[k] = v.clone() if isinstance(v, torch.Tensor) else v
                else:
                    doc[k] = whole[e.offset : e.offset + e.numel].view(e.shape).clone()
        first += len(u.entries)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": ids}
        for g, ids in zip(optimizer.param_groups, _groups(optimizer, units))
    ]
    return {"state": state, "param_groups": groups}


def check_full_optim_state(
    optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit], sd: Any, where: str
) -> None:
    """Refuse ``optim_state`` that is not of this model's optimizer, before anything changes."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise TypeError(
            f"{where}: optim_state must be a torch.optim state dict with 'state' and "
            f"'param_groups' (as full_optim_state_dict gives), got {type(sd).__name__}"
        )
    here = [len(ids) for ids in _groups(optimizer, units)]
    saved = [len(g["params"]) for g in sd["param_groups"]]
    if saved != here:
        raise ValueError(
            f"{where}: optim_state is of another model: its parameter groups hold {saved} "
            f"parameters, this optimizer's hold {here}"
        )
    entries = [e for u in units for e in u.entries]
    for i, doc in sd["state"].items():
        if not 0 <= int(i) < len(entries):
            raise ValueError(
                f"{where}: optim_state is of another model: it has state for parameter {i}, "
                f"the model has {len(entries)}"
            )
        for k, v in (doc or {}).items():
            if _per_element(v) and v.numel() != entries[int(i)].numel:
                raise ValueError(
                    f"{where}: optim_state is of another model: its state {k!r} of parameter "
                    f"{i} ({entries[int(i)].keys[0]}) has shape {tuple(v.shape)}, the "
                    f"parameter {entries[int(i)].shape}"
                )


@torch.no_grad()
def _cut(u: FlatUnit, first: int, saved: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """This rank's shard of unit ``u``'s state (its parameters numbered from ``first``)."""
    docs = [saved[first + i] for i in range(len(u.entries)) if saved.get(first + i)]
    if not docs:
        return None
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in docs[0].items()}
    for k, v in docs[0].items():
        if _per_element(v):
            out[k] = torch.zeros(u.chunk, dtype=v.dtype, device=u.device)
    index = {e.keys[0]: first + i for i, e in enumerate(u.entries)}
    for piece in u.pieces:
        for k, v in saved.get(index[piece.key], {}).items():
            if _per_element(v):
                piece.held_in(out[k]).copy_(piece.of_full(v))
    return out


def load_full_optim_state_dict(
    optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit], sd: dict[str, Any]
) -> None:
    """Keep this rank's shards of a full state (:func:`full_optim_state_dict`'s format)."""
    check_full_optim_state(optimizer, units, sd, "load_full_optim_state_dict")
    saved = {int(k): v for k, v in sd["state"].items() if v}
    where = _flat_index(optimizer, units)
    state, first = {}, 0
    for u_i, u in enumerate(units):
        cut = _cut(u, first, saved)
        if cut is not None and u_i in where:
            state[where[u_i]] = cut
        first += len(u.entries)
    groups, first = [], 0
    for g, doc in zip(optimizer.param_groups, sd["param_groups"]):
        options = {k: v for k, v in doc.items() if k != "params"}
        groups.append({**options, "params": list(range(first, first + len(g["params"])))})
        first += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
