"""Sharded sections: each rank writes its own pieces; any world size reads them back.

A model or optimizer implementing :class:`phalanx.sharding.Sharded` (ZeRO-1/2 optimizers, ZeRO-3
models and the optimizers over them, split mesh models) is not gathered to rank 0. Each rank writes
``<what>-shard-<rank>.safetensors`` (its pieces) and ``.json`` (``meta`` and the piece index: tensor
key, full shape, element range). On load, every rank reads the indexes of all saved ranks and a
:class:`~phalanx.sharding.PieceReader` fetches just the files whose pieces overlap the ranges its
own layout needs — so a checkpoint saved by 4 ranks loads at 2, at 1, or at 8. A plain module or
optimizer can load a sharded checkpoint too: its full tensors are assembled from the pieces.

An index is checked before anything is allocated: every entry well-formed (shape within
``limits.shape_ok``, a torch dtype), the bytes its pieces claim within those of its tensor
files, each tensor's pieces holding at least its elements, ``num_params`` what its groups list.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint import structure
from phalanx.checkpoint.limits import shape_ok
from phalanx.checkpoint.manifest import CheckpointError, Manifest
from phalanx.checkpoint.sections import Section, _json, read_tensor_file
from phalanx.sharding.optimizer_pieces import optimizer_view
from phalanx.sharding.pieces import Piece, PieceReader, Sharded, dtype_name

__all__ = ["as_sharded", "is_sharded_in", "read_sharded", "shard_section", "shard_section_name"]


def shard_section_name(what: str, rank: int) -> str:
    """``optimizer-shard-00003``: rank 3's pieces of ``what``."""
    return f"{what}-shard-{rank:05d}"


def as_sharded(model: nn.Module | None, optimizer: Any) -> tuple[Any, Any]:
    """``(model, optimizer)`` as :class:`Sharded` objects where their state is sharded.

    An optimizer over a ZeRO-3 model's flat shards is a plain ``torch.optim`` optimizer; the
    model knows its layout (``shard_layout()``) and gives a sharded view of it.
    """
    sharded_model = model if isinstance(model, Sharded) else None
    sharded_opt = optimizer if isinstance(optimizer, Sharded) else None
    if sharded_opt is None:
        sharded_opt = optimizer_view(model, optimizer)
    return sharded_model, sharded_opt


def shard_section(what: str, rank: int, obj: Sharded) -> Section:
    """This rank's pieces of ``obj`` as a section ready to write."""
    state = obj.sharded_state()
    index = [[p.to_json(dtype_name(t.dtype)), f"t{i}"] for i, (p, t) in enumerate(state.pieces)]
    tensors = {f"t{i}": t.detach().contiguous() for i, (_, t) in enumerate(state.pieces)}
    doc = {"meta": state.meta, "index": index, "tensors": tensors}
    return Section.of(shard_section_name(what, rank), doc, f"{what} shard state")


def is_sharded_in(manifest: Manifest, what: str) -> bool:
    """Whether the checkpoint holds ``what`` as per-rank pieces."""
    return f"{shard_section_name(what, 0)}.json" in manifest.files


def _piece(entry: Any, where: Path) -> tuple[Piece, str, str]:
    """``(piece, dtype, tensor name)`` of an index entry, every field checked."""
    ok = (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], list)
        and len(entry[0]) == 5
        and isinstance(entry[1], str)
    )
    if ok:
        key, shape, start, end, dtype = entry[0]
        ok = (
            isinstance(key, str)
            and shape_ok(shape)
            and isinstance(start, int)
            and isinstance(end, int)
            and isinstance(dtype, str)
            and isinstance(getattr(torch, dtype, None), torch.dtype)
        )
    if not ok:
        raise CheckpointError(f"{where}: malformed piece index entry {entry!r:.200}")
    try:
        piece, dtype = Piece.from_json(entry[0])
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return piece, dtype, entry[1]


def _listed_params(groups: Any) -> int | None:
    """How many parameters ``param_groups`` lists (None when it is malformed)."""
    if not isinstance(groups, list):
        return None
    counts = [
        len(g["params"])
        for g in groups
        if isinstance(g, dict) and isinstance(g.get("params"), list)
    ]
    return sum(counts) if len(counts) == len(groups) else None


def _check_meta(meta: Any, where: Path) -> dict[str, Any]:
    """``meta`` is an object; an optimizer's ``num_params`` is the count its groups list."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: 'meta' is a {type(meta).__name__}, not an object")
    n = meta.get("num_params")
    if "num_params" in meta and (
        not isinstance(n, int) or n != _listed_params(meta.get("param_groups"))
    ):
        raise CheckpointError(
            f"{where}: num_params {str(n)[:20]} is not the number of parameters its "
            f"param_groups list"
        )
    return meta


def _index(
    ckpt: Path, manifest: Manifest, name: str
) -> tuple[dict[str, Any], list[tuple[Piece, str, str, str]]]:
    """``meta`` and the pieces of ``name``, bounded by the bytes of its tensor files."""
    where = ckpt / f"{name}.json"
    doc = _json(ckpt, manifest, f"{name}.json")
    state = doc.get("state")
    if not isinstance(state, dict) or not isinstance(state.get("index"), list):
        raise CheckpointError(f"{where}: no piece index ('state.index' list)")
    index = {"meta": state.get("meta"), "index": state["index"]}
    plain = structure.unflatten(index, {}, str(where))
    pieces = [_piece(e, where) for e in plain["index"]]
    claimed = sum(p.numel * getattr(torch, d).itemsize for p, d, _ in pieces)
    held = sum(manifest.entry(ckpt, f).bytes for f in doc["tensor_files"])
    if claimed > held:
        raise CheckpointError(
            f"{where}: its pieces claim {claimed} bytes, its tensor files hold {held}"
        )
    return _check_meta(plain["meta"], where), [(p, d, name, t) for p, d, t in pieces]


def _check_coverage(ckpt: Path, what: str, index: list[tuple[Piece, str, str, str]]) -> None:
    """Each tensor's pieces hold at least its elements (so no read allocates more than the
    files hold)."""
    held: dict[str, int] = {}
    for piece, *_ in index:
        held[piece.key] = held.get(piece.key, 0) + piece.numel
    for piece, *_ in index:
        if math.prod(piece.shape) > held[piece.key]:
            raise CheckpointError(
                f"{ckpt}: the {what} pieces of {piece.key!r:.80} hold {held[piece.key]} of its "
                f"{math.prod(piece.shape)} elements; the checkpoint is incomplete or crafted"
            )


def read_sharded(ckpt: Path, manifest: Manifest, what: str) -> tuple[dict[str, Any], PieceReader]:
    """Rank 0's ``meta`` and a reader over every saved rank's pieces of ``what``."""
    index: list[tuple[Piece, str, str, str]] = []
    meta: dict[str, Any] = {}
    for r in range(manifest.world_size):  # bounded by the rank files (read_manifest)
        name = shard_section_name(what, r)
        if f"{name}.json" not in manifest.files:
            raise CheckpointError(
                f"{ckpt} was saved by {manifest.world_size} ranks but holds no {name}.json: "
                f"the {what} state is incomplete"
            )
        rank_meta, pieces = _index(ckpt, manifest, name)
        meta = rank_meta if r == 0 else meta
        index.extend(pieces)
    _check_coverage(ckpt, what, index)

    opened: dict[str, dict[str, Any]] = {}

    def fetch(source: str) -> dict[str, Any]:
        # Map and verify a source's files once (crc32c of the mapped bytes); a rank then
        # copies only the element ranges it needs out of the map.
        if source not in opened:
            opened[source] = _open_source(ckpt, manifest, source)
        return opened[source]

    return meta, PieceReader(index, fetch)


def _open_source(ckpt: Path, manifest: Manifest, source: str) -> dict[str, Any]:
    doc = _json(ckpt, manifest, f"{source}.json")
    slices: dict[str, Any] = {}
    for f in doc["tensor_files"]:
        slices.update(read_tensor_file(ckpt, manifest, f))
    try:
        tensors = doc["state"]["tensors"]
        return {name: slices[ref["__tensor__"]] for name, ref in tensors.items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{ckpt / source}.json: its tensors do not match its files ({exc!r:.200})"
        ) from None
