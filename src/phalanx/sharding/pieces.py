"""One record for a shard of state: elements ``start:end`` of a flattened full tensor.

Every sharded object in phalanx says what a rank holds with :class:`Piece` records: a ZeRO-1/2
rank's ranges of the optimizer state, a ZeRO-3 rank's flat shard of each unit, a tensor-parallel
slice of a split weight (one piece per contiguous run, :func:`slice_pieces`), and the index of a
sharded checkpoint. The idea is torch DCP's ``ChunkStorageMetadata`` (offsets and sizes of a
chunk of an n-D tensor), flattened: an element range of the row-major flattening, so a chunk of
any shape is a list of pieces and any two layouts can be intersected range by range.

Keys name tensors independently of the world size (a model's state-dict name, or ZeRO-1/2's
``param<i>`` for the ``i``-th parameter in optimizer order, :func:`param_key`), and a tensor's
optimizer state is keyed ``<key>/<state>`` (:meth:`Piece.of_state`), so a checkpoint written by
4 ranks is read by 2 or 1:
each rank asks a :class:`PieceReader` for the element ranges its own layout needs
(:func:`overlaps`), and the reader assembles them from whichever saved pieces cover them.

Objects opt in by implementing :class:`Sharded`; ``phalanx.checkpoint`` then writes one file per
rank instead of gathering to rank 0. This module depends on nothing else in phalanx.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "HeldPieces",
    "Piece",
    "PieceReader",
    "Sharded",
    "ShardedState",
    "dtype_name",
    "overlaps",
    "param_index",
    "param_key",
    "pieces_in_range",
    "slice_pieces",
]


@dataclass(frozen=True)
class Piece:
    """Elements ``start:end`` of the flattened tensor ``key`` whose full shape is ``shape``,
    held at ``offset`` of the flat local tensor that holds it (0 for a tensor of its own)."""

    key: str
    shape: tuple[int, ...]
    start: int
    end: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end <= math.prod(self.shape) or self.offset < 0:
            raise ValueError(
                f"Piece {self.key!r}: elements {self.start}:{self.end} at offset {self.offset} "
                f"do not fit a tensor of shape {self.shape} ({math.prod(self.shape)} elements)"
            )

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return self.end - self.start

    @property
    def held(self) -> slice:
        """Where the piece sits in the 1-D local tensor that holds it (precomputable for loops
        that run every step)."""
        return slice(self.offset, self.offset + self.numel)

    @property
    def elements(self) -> slice:
        """The piece's elements of the flattened tensor ``key``."""
        return slice(self.start, self.end)

    def held_in(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece's elements in ``flat`` (the 1-D local tensor that holds it)."""
        return flat[self.offset : self.offset + self.numel]

    def of_full(self, full: torch.Tensor) -> torch.Tensor:
        """The piece's elements of ``full`` (the whole tensor ``key``, any shape)."""
        return full.reshape(-1)[self.start : self.end]

    def of_state(self, name: str) -> Piece:
        """The same elements of the optimizer state ``name`` of this tensor: key
        ``<key>/<name>``, at offset 0 (a tensor of its own)."""
        return Piece(f"{self.key}/{name}", self.shape, self.start, self.end)

    def to_json(self, dtype: str) -> list[Any]:
        """The checkpoint index entry ``[key, shape, start, end, dtype]`` (offset is local)."""
        return [self.key, list(self.shape), self.start, self.end, dtype]

    @staticmethod
    def from_json(doc: list[Any]) -> tuple[Piece, str]:
        """``(piece, dtype)`` from an index entry written by :meth:`to_json`."""
        key, shape, start, end, dtype = doc
        return Piece(str(key), tuple(int(s) for s in shape), int(start), int(end)), str(dtype)


HeldPieces = list[tuple[torch.Tensor, list[Piece]]]
"""Flat local tensors, each with the pieces it holds (by :attr:`Piece.offset`)."""


def param_key(index: int) -> str:
    """``param<index>``: the key of ZeRO-1/2's parameter ``index`` (global optimizer order)."""
    return f"param{index}"


def param_index(key: str) -> int:
    """The index in a :func:`param_key` key (``"param3"`` -> 3)."""
    digits = key.removeprefix("param")
    if digits == key or not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"param_index: key {key!r} is not param<i> (a ZeRO-1/2 parameter key)")
    return int(digits)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the dtype as a checkpoint index stores it)."""
    return str(dtype).removeprefix("torch.")


def pieces_in_range(
    entries: Sequence[tuple[str, tuple[int, ...], int]], lo: int, hi: int
) -> list[Piece]:
    """The pieces of tensors laid end to end in one flat buffer that fall in ``lo:hi``.

    Args:
        entries: ``(key, full shape, offset in the flat buffer)`` of each tensor.
        lo: First element of the range (a ZeRO-3 rank's shard: ``rank * chunk``).
        hi: End of the range.

    Returns:
        One piece per tensor that overlaps the range, its offset counted from ``lo``.
    """
    if not 0 <= lo <= hi:
        raise ValueError(f"pieces_in_range: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    out: list[Piece] = []
    for key, shape, offset in entries:
        a, b = max(lo, offset), min(hi, offset + math.prod(shape))
        if a < b:
            out.append(Piece(key, shape, a - offset, b - offset, a - lo))
    return out


def slice_pieces(key: str, shape: tuple[int, ...], dim: int, start: int, end: int) -> list[Piece]:
    """The pieces of the slice ``start:end`` along tensor dimension ``dim`` of ``shape``.

    Row-major: a slice along dim 0 is one run; along dim d there is one run per index of the
    dimensions before d (a column block of a matrix is one piece per row). Offsets are the
    runs' places in the contiguous sliced tensor.
    """
    if not 0 <= dim < len(shape) or not 0 <= start <= end <= shape[dim]:
        raise ValueError(
            f"slice_pieces: {key!r} of shape {shape} has no slice {start}:{end} along dim {dim}"
        )
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    width, stride = (end - start) * inner, shape[dim] * inner
    return [
        Piece(key, shape, o * stride + start * inner, o * stride + start * inner + width, o * width)
        for o in range(outer)
    ]


def overlaps(saved: Sequence[Piece], start: int, end: int) -> list[tuple[int, int, int]]:
    """Which saved pieces of one key supply elements ``start:end`` (the ranges a rank needs
    when it reads state saved at another layout), and which elements each supplies.

    ``saved`` must be sorted by ``start``. Returns ``(index in saved, lo, hi)`` in order, with
    ``lo:hi`` inside both the piece and the wanted range.

    Raises:
        ValueError: the pieces do not cover ``start:end``, naming the first missing elements.
    """
    out: list[tuple[int, int, int]] = []
    covered = start
    for i, piece in enumerate(saved):
        lo, hi = max(piece.start, start), min(piece.end, end)
        if lo >= hi:
            continue
        if lo > covered:
            break
        out.append((i, lo, hi))
        covered = max(covered, hi)
    if covered < end:
        key = saved[0].key if saved else "?"
        raise ValueError(
            f"the checkpoint's pieces of {key!r} do not cover elements {covered}:{end}; "
            f"it is incomplete (a rank's shard file is missing)"
        )
    return out


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
        index: Every saved piece with its dtype, the source (file id) that holds it and its
            tensor name there.
        fetch: Loads one source's tensors by name (called lazily; the last source is cached).
    """

    def __init__(
        self,
        index: Iterable[tuple[Piece, str, str, str]],
        fetch: Callable[[str], dict[str, torch.Tensor]],
    ) -> None:
        self._by_key: dict[str, list[tuple[Piece, str, str, str]]] = {}
        for entry in index:
            self._by_key.setdefault(entry[0].key, []).append(entry)
        for entries in self._by_key.values():
            entries.sort(key=lambda e: e[0].start)
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
        dtype: torch.dtype = getattr(torch, self._pieces(key)[0][1])
        return dtype

    def _pieces(self, key: str) -> list[tuple[Piece, str, str, str]]:
        if key not in self._by_key:
            raise KeyError(f"the checkpoint holds no tensor {key!r}")
        return self._by_key[key]

    def _source(self, source: str) -> dict[str, torch.Tensor]:
        if self._cached is None or self._cached[0] != source:
            self._cached = (source, self._fetch(source))
        return self._cached[1]

    def read(self, key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``start:end`` of flattened ``key`` (into ``out`` when given, 1-D)."""
        entries = self._pieces(key)
        numel = math.prod(entries[0][0].shape)
        if not 0 <= start <= end <= numel:
            raise ValueError(f"range {start}:{end} is outside {key!r} of {numel} elements")
        if out is None:
            out = torch.empty(end - start, dtype=self.dtype(key))
        for i, lo, hi in overlaps([e[0] for e in entries], start, end):
            piece, _, source, name = entries[i]
            data = self._source(source)[name]
            out[lo - start : hi - start].copy_(data[lo - piece.start : hi - piece.start])
        return out

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` in its saved shape."""
        shape = self.shape(key)
        return self.read(key, 0, math.prod(shape)).view(shape)
