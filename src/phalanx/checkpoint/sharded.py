"""Sharded sections: each rank writes its own pieces; any world size reads them back.

A model or optimizer implementing :class:`phalanx.sharding.Sharded` (ZeRO-1/2 optimizers, ZeRO-3
models and the optimizers over them, split mesh models) is not gathered to rank 0. Each rank writes
``<what>-shard-<rank>.safetensors`` (its pieces) and ``.json`` (``meta`` and the piece index: tensor
key, full shape, element range). On load, every rank reads the indexes of all saved ranks and a
:class:`~phalanx.sharding.PieceReader` fetches just the files whose pieces overlap the ranges its
own layout needs — so a checkpoint saved by 4 ranks loads at 2, at 1, or at 8. A plain module or
optimizer can load a sharded checkpoint too: its full tensors are assembled from the pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from phalanx.checkpoint import structure
from phalanx.checkpoint.format import open_mapped
from phalanx.checkpoint.manifest import CheckpointError, Manifest, safe_path, verify_files
from phalanx.checkpoint.sections import Section, _json
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


def read_sharded(ckpt: Path, manifest: Manifest, what: str) -> tuple[dict[str, Any], PieceReader]:
    """Rank 0's ``meta`` and a reader over every saved rank's pieces of ``what``."""
    index: list[tuple[Piece, str, str, str]] = []
    meta: dict[str, Any] = {}
    for r in range(manifest.world_size):
        name = shard_section_name(what, r)
        if f"{name}.json" not in manifest.files:
            raise CheckpointError(
                f"{ckpt} was saved by {manifest.world_size} ranks but holds no {name}.json: "
                f"the {what} state is incomplete"
            )
        doc = _json(ckpt, manifest, f"{name}.json")["state"]
        where = str(ckpt / f"{name}.json")
        plain = structure.unflatten({"meta": doc["meta"], "index": doc["index"]}, {}, where)
        if r == 0:
            meta = plain["meta"]
        index.extend((*Piece.from_json(p), name, t) for p, t in plain["index"])

    opened: dict[str, dict[str, Any]] = {}

    def fetch(source: str) -> dict[str, Any]:
        # Verify a source's files once (streaming sha256), then slice them through mmap: a rank
        # reads only the element ranges it needs, never a whole peer's state.
        if source not in opened:
            doc = _json(ckpt, manifest, f"{source}.json")
            files = {f: manifest.files[f] for f in doc["tensor_files"]}
            verify_files(ckpt, Manifest(manifest.step, manifest.world_size, files, []))
            slices: dict[str, Any] = {}
            for f in files:
                slices.update(open_mapped(safe_path(ckpt, f)))
            tensors = doc["state"]["tensors"]
            opened[source] = {name: slices[ref["__tensor__"]] for name, ref in tensors.items()}
        return opened[source]

    return meta, PieceReader(index, fetch)
