"""World-size-independent sharded state: pieces of flattened tensors, read back at any layout.

A sharded object (a ZeRO optimizer, a ZeRO-3 model) describes what it holds as
:class:`Piece` records: "elements ``start:end`` of the flattened tensor ``key`` (full shape
``shape``)". Keys name tensors independently of the world size (a model's state-dict name, or
``param<i>/<state>`` for optimizer state), so a checkpoint written by 4 ranks can be read by 2
or 1: each rank asks a :class:`PieceReader` for the element ranges its own layout needs, and
the reader assembles them from whichever saved pieces overlap.

Objects opt in by implementing :class:`Sharded`; ``phalanx.checkpoint`` then writes one file
per rank instead of gathering to rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Piece", "PieceReader", "Sharded", "ShardedState"]


@dataclass(frozen=True)
class Piece:
    """Elements ``start:end`` of the flattened tensor ``key`` whose full shape is ``shape``."""

    key: str
    shape: tuple[int, ...]
    start: int
    end: int
    dtype: str

    def to_json(self) -> list[Any]:
        return [self.key, list(self.shape), self.start, self.end, self.dtype]

    @staticmethod
    def from_json(doc: list[Any]) -> Piece:
        key, shape, start, end, dtype = doc
        return Piece(str(key), tuple(int(s) for s in shape), int(start), int(end), str(dtype))


@dataclass
class ShardedState:
    """What one rank contributes: JSON-able ``meta`` plus tensor pieces (1-D, contiguous)."""

    meta: dict[str, Any]
    pieces: list[tuple[Piece, torch.Tensor]]


@runtime_checkable
class Sharded(Protocol):
    """An object whose state is split across ranks and can be re-split on load."""

    def sharded_state(self) -> ShardedState:
        """This rank's pieces (views are fine: they are copied when written)."""
        ...

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        """Restore from ``meta`` (rank 0's at save time) and pieces read through ``reader``."""
        ...


class PieceReader:
    """Assembles element ranges of saved tensors from pieces written by any number of ranks.

    Args:
        index: Every saved piece with the source (file id) that holds it and its name there.
        fetch: Loads one source's tensors by name (called lazily; the last source is cached).
    """

    def __init__(
        self,
        index: Iterable[tuple[Piece, str, str]],
        fetch: Callable[[str], dict[str, torch.Tensor]],
    ) -> None:
        self._by_key: dict[str, list[tuple[Piece, str, str]]] = {}
        for piece, source, name in index:
            self._by_key.setdefault(piece.key, []).append((piece, source, name))
        for pieces in self._by_key.values():
            pieces.sort(key=lambda item: item[0].start)
        self._fetch = fetch
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def keys(self) -> list[str]:
        """Every tensor key the checkpoint holds pieces of."""
        return sorted(self._by_key)

    def shape(self, key: str) -> tuple[int, ...]:
        """Full (unsharded) shape of ``key``."""
        return self._pieces(key)[0][0].shape

    def dtype(self, key: str) -> torch.dtype:
        """Saved dtype of ``key``."""
        return getattr(torch, self._pieces(key)[0][0].dtype)

    def _pieces(self, key: str) -> list[tuple[Piece, str, str]]:
        if key not in self._by_key:
            raise KeyError(f"the checkpoint holds no tensor {key!r}")
        return self._by_key[key]

    def _source(self, source: str) -> dict[str, torch.Tensor]:
        if self._cached is None or self._cached[0] != source:
            self._cached = (source, self._fetch(source))
        return self._cached[1]

    def read(self, key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``start:end`` of flattened ``key`` (into ``out`` when given, 1-D)."""
        pieces = self._pieces(key)
        numel = 1
        for s in pieces[0][0].shape:
            numel *= s
        if not 0 <= start <= end <= numel:
            raise ValueError(f"range {start}:{end} is outside {key!r} of {numel} elements")
        if out is None:
            out = torch.empty(end - start, dtype=self.dtype(key))
        covered = start
        for piece, source, name in pieces:
            lo, hi = max(piece.start, start), min(piece.end, end)
            if lo >= hi:
                continue
            if lo > covered:
                break
            data = self._source(source)[name]
            out[lo - start : hi - start].copy_(data[lo - piece.start : hi - piece.start])
            covered = max(covered, hi)
        if covered < end:
            raise ValueError(
                f"the checkpoint's pieces of {key!r} do not cover elements {covered}:{end}; "
                f"it is incomplete (a rank's shard file is missing)"
            )
        return out

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` in its saved shape."""
        shape = self.shape(key)
        numel = 1
        for s in shape:
            numel *= s
        return self.read(key, 0, numel).view(shape)
