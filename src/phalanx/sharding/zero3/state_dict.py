"""ZeRO-3 state: full state dicts (gathered, original keys) and world-size-free sharded pieces.

Keys are always the wrapped module's own state-dict keys, so a checkpoint written from a
``FullyShardedDataParallel`` loads into the plain model and back, and sharded pieces written
by N ranks load at any other world size (:mod:`phalanx.sharding.pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from phalanx.comm import collectives as c
from phalanx.sharding.pieces import Piece, PieceReader, ShardedState
from phalanx.sharding.zero3.unit import Entry, FlatUnit, GroupInfo

__all__ = [
    "StateLayout",
    "check_full_state",
    "full_state_dict",
    "gather_flat_tensor",
    "load_full_state_dict",
    "load_sharded_state",
    "sharded_state",
]


@dataclass
class StateLayout:
    """The original state dict's keys, in order, and where each value now lives."""

    keys: list[str] = field(default_factory=list)
    params: dict[str, tuple[FlatUnit, Entry]] = field(default_factory=dict)
    """Every parameter key (tied aliases included) -> its unit and entry."""
    buffers: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Persistent buffer key -> (owning module, buffer name)."""

    @staticmethod
    def tensor_keys(module: nn.Module) -> list[str]:
        """``module``'s state-dict keys holding tensors (call before sharding it)."""
        sd = module.state_dict(keep_vars=True)
        return [k for k, v in sd.items() if isinstance(v, torch.Tensor)]

    @staticmethod
    def build(keys: list[str], module: nn.Module, units: list[FlatUnit]) -> StateLayout:
        """Locate every key of :meth:`tensor_keys` in the units or among the buffers.

        Extra state (``get_extra_state``) is not handled.
        """
        layout = StateLayout(keys=list(keys))
        layout.params = {k: (u, e) for u in units for e in u.entries for k in e.keys}
        for key in keys:
            if key not in layout.params:
                prefix, _, name = key.rpartition(".")
                layout.buffers[key] = (module.get_submodule(prefix), name)
        return layout

    def buffer(self, key: str) -> torch.Tensor:
        mod, name = self.buffers[key]
        buf = mod._buffers[name]
        assert buf is not None
        return buf


@torch.no_grad()
def gather_flat_tensor(unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    """Every rank's ``shard`` (shaped like the unit's flat shard) laid end to end: the unit's
    padded flat layout (a collective: every rank calls it)."""
    out = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
    c.all_gather_into_tensor(out, shard.detach().reshape(-1), group=unit.info.group)
    return out


def gather_flat(unit: FlatUnit) -> torch.Tensor:
    """The unit's full flat tensor in its original dtype (a collective: every rank calls it)."""
    return gather_flat_tensor(unit, unit.flat_param)


def full_state_dict(
    layout: StateLayout, units: list[FlatUnit], info: GroupInfo, rank0_only: bool
) -> dict[str, torch.Tensor]:
    """Gathered parameters and buffers under the original keys (``{}`` off rank 0 if asked:
    the first rank of the first replica under hybrid sharding)."""
    keep = not rank0_only or (info.rank == 0 and info.replica == 0)
    values: dict[int, torch.Tensor] = {}  # id(entry) -> full parameter
    for unit in units:
        flat = gather_flat(unit)
        if keep:
            for e in unit.entries:
                values[id(e)] = flat[e.offset : e.offset + e.numel].view(e.shape).clone()
        del flat
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key in layout.keys:
        if key in layout.params:
            out[key] = values[id(layout.params[key][1])]  # tied aliases share one tensor
        else:
            out[key] = layout.buffer(key).detach().clone()
    return out


def _pick(keys: list[str], available: Mapping[str, Any] | set[str]) -> str | None:
    return next((k for k in keys if k in available), None)


def missing_keys(layout: StateLayout, available: Mapping[str, Any] | set[str]) -> list[str]:
    """Keys of ``layout`` with no value in ``available`` (a tied parameter needs one alias)."""
    missing = [k for k in layout.buffers if k not in available]
    for entry in {id(e): e for _, e in layout.params.values()}.values():
        if _pick(entry.keys, available) is None:
            missing.append(entry.keys[0])
    return missing


def _held(
    layout: StateLayout, units: list[FlatUnit], available: Mapping[str, Any] | set[str]
) -> Iterator[tuple[torch.Tensor, Piece, Entry, str]]:
    """Each piece of this rank's shards: where it sits, the piece, its parameter and the key
    of ``available`` that holds it (``missing_keys`` must have found none missing)."""
    for unit in units:
        shard = unit.flat_param.detach()
        for piece in unit.pieces:
            entry = layout.params[piece.key][1]
            key = _pick(entry.keys, available)
            assert key is not None
            yield piece.held_in(shard), piece, entry, key


def check_full_state(layout: StateLayout, state: Any, where: str) -> None:
    """Refuse a full state of another model (a key missing, a shape differing), naming it."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{where}: full_state must be the model's full state dict (as state_dict() gives), "
            f"got {type(state).__name__}"
        )
    missing = missing_keys(layout, state)
    if missing:
        raise ValueError(f"{where}: full_state is of another model: it lacks keys {missing}")
    for key, (_, entry) in layout.params.items():
        value = state.get(key)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != entry.shape:
            raise ValueError(
                f"{where}: full_state is of another model: {key!r} has shape "
                f"{tuple(value.shape)}, the model's is {entry.shape}"
            )


@torch.no_grad()
def load_full_state_dict(
    layout: StateLayout, units: list[FlatUnit], state: Mapping[str, torch.Tensor], rank: int
) -> None:
    """Copy this rank's shard of every full parameter (and every buffer) from ``state``."""
    missing = missing_keys(layout, state)
    if missing:
        raise KeyError(f"[rank {rank}] load_full_state_dict: state is missing keys {missing}")
    for held, piece, entry, key in _held(layout, units, state):
        value = state[key]
        if tuple(value.shape) != entry.shape:
            raise ValueError(
                f"[rank {rank}] load_full_state_dict: {key!r} has shape "
                f"{tuple(value.shape)}, the model's is {entry.shape}"
            )
        held.copy_(piece.of_full(value))
    for key in layout.buffers:
        layout.buffer(key).copy_(state[key])


def sharded_state(layout: StateLayout, units: list[FlatUnit], info: GroupInfo) -> ShardedState:
    """This rank's pieces of every parameter; buffers whole from the group's rank 0. Under
    hybrid sharding only the first replica writes (the others hold equal shards): no pieces."""
    pieces: list[tuple[Piece, torch.Tensor]] = []
    if info.replica != 0:
        return ShardedState({"zero3_world_size": info.world}, pieces)
    for unit in units:
        shard = unit.flat_param.detach()
        pieces += [(Piece(p.key, p.shape, p.start, p.end), p.held_in(shard)) for p in unit.pieces]
    if info.rank == 0:
        for key in layout.buffers:
            buf = layout.buffer(key).detach()
            piece = Piece(key, tuple(buf.shape), 0, buf.numel())
            pieces.append((piece, buf.reshape(-1).contiguous()))
    return ShardedState({"zero3_world_size": info.world}, pieces)


@torch.no_grad()
def load_sharded_state(
    layout: StateLayout, units: list[FlatUnit], reader: PieceReader, rank: int
) -> None:
    """Fill this rank's shard from pieces saved at any world size."""
    available = set(reader.keys())
    missing = missing_keys(layout, available)
    if missing:
        raise KeyError(f"[rank {rank}] load_sharded_state: the checkpoint lacks keys {missing}")
    for held, piece, _, key in _held(layout, units, available):
        reader.read(key, piece.start, piece.end, out=held)
    for key in layout.buffers:
        layout.buffer(key).copy_(reader.full(key))
