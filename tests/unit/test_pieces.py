"""The one record for a shard of state: validation, index form, overlaps, resharded reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.sharding.pieces import (
    Piece,
    PieceReader,
    overlaps,
    param_index,
    param_key,
    pieces_in_range,
    slice_pieces,
)


@pytest.mark.parametrize(
    ("start", "end", "offset", "shown"),
    [(3, 2, 0, "elements 3:2"), (0, 7, 0, "elements 0:7"), (-1, 2, 0, "-1:2"), (0, 1, -2, "-2")],
)
def test_a_piece_outside_its_tensor_is_refused(
    start: int, end: int, offset: int, shown: str
) -> None:
    with pytest.raises(ValueError, match=rf"Piece 'w'.*{shown}.*\(2, 3\) \(6 elements\)"):
        Piece("w", (2, 3), start, end, offset)


def test_a_piece_reads_its_elements_from_the_full_tensor_and_its_holder() -> None:
    full = torch.arange(12.0).reshape(3, 4)
    piece = Piece("w", (3, 4), 5, 9, offset=2)
    holder = torch.zeros(8)
    piece.held_in(holder).copy_(piece.of_full(full))
    assert piece.numel == 4
    assert holder.tolist() == [0, 0, 5, 6, 7, 8, 0, 0]
    assert Piece("step", (), 0, 1).numel == 1  # a scalar is one element of shape ()


def test_a_pieces_slices_and_state_piece_name_the_same_elements() -> None:
    piece = Piece("param3", (3, 4), 5, 9, offset=2)
    assert (piece.held.start, piece.held.stop) == (2, 6)
    assert (piece.elements.start, piece.elements.stop) == (5, 9)
    # ZeRO-1/2 keys optimizer state "param<i>/<state>", at offset 0 (a tensor of its own)
    assert piece.of_state("exp_avg") == Piece("param3/exp_avg", (3, 4), 5, 9)


@pytest.mark.parametrize("index", [0, 7, 123])
def test_param_keys_round_trip(index: int) -> None:
    assert param_key(index) == f"param{index}"
    assert param_index(param_key(index)) == index


@pytest.mark.parametrize("key", ["weight", "param", "param1/exp_avg", "paramx", "param-1"])
def test_param_index_names_a_key_that_is_not_a_parameter_key(key: str) -> None:
    with pytest.raises(ValueError, match=rf"key '{key}' is not param<i>"):
        param_index(key)


def test_the_index_entry_is_the_on_disk_form_and_drops_the_local_offset() -> None:
    piece = Piece("layer.weight", (4, 2), 2, 6, offset=3)
    doc = piece.to_json("bfloat16")
    assert doc == ["layer.weight", [4, 2], 2, 6, "bfloat16"]  # as phalanx.zero/2 wrote it
    assert Piece.from_json(doc) == (Piece("layer.weight", (4, 2), 2, 6), "bfloat16")


def test_pieces_in_range_cut_tensors_laid_end_to_end() -> None:
    entries = [("a", (2, 2), 0), ("b", (5,), 4), ("c", (1,), 9)]
    assert pieces_in_range(entries, 3, 6) == [
        Piece("a", (2, 2), 3, 4, 0),
        Piece("b", (5,), 0, 2, 1),
    ]
    assert pieces_in_range(entries, 10, 12) == []  # padding holds no tensor
    with pytest.raises(ValueError, match="lo=5, hi=4"):
        pieces_in_range(entries, 5, 4)


def test_slice_pieces_refuse_a_slice_the_shape_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"'w' of shape \(3, 4\) has no slice 1:5 along dim 1"):
        slice_pieces("w", (3, 4), 1, 1, 5)
    with pytest.raises(ValueError, match="along dim 2"):
        slice_pieces("w", (3, 4), 2, 0, 1)


def _saved(numel: int, world: int) -> list[Piece]:
    chunk = -(-numel // world)
    return [
        Piece("t", (numel,), r * chunk, min(numel, (r + 1) * chunk))
        for r in range(world)
        if r * chunk < numel
    ]


def test_overlaps_name_the_pieces_a_new_layout_needs() -> None:
    saved = _saved(10, 3)  # 0:4, 4:8, 8:10
    assert overlaps(saved, 3, 9) == [(0, 3, 4), (1, 4, 8), (2, 8, 9)]
    assert overlaps(saved, 4, 8) == [(1, 4, 8)]
    assert overlaps(saved, 5, 5) == []
    with pytest.raises(ValueError, match=r"'t' do not cover elements 4:9.*incomplete"):
        overlaps([saved[0], saved[2]], 2, 9)


@pytest.mark.parametrize(("saved_world", "read_world"), [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_a_reader_reshards_pieces_of_any_world_size(saved_world: int, read_world: int) -> None:
    full = torch.arange(22, dtype=torch.float64).reshape(2, 11)
    pieces = [Piece("w", (2, 11), p.start, p.end) for p in _saved(22, saved_world)]
    files = {f"rank{i}": {"x": p.of_full(full).clone()} for i, p in enumerate(pieces)}
    fetched: list[str] = []

    def fetch(source: str) -> dict[str, torch.Tensor]:
        fetched.append(source)
        return files[source]

    index = [(p, "float64", f"rank{i}", "x") for i, p in enumerate(pieces)]
    reader = PieceReader(reversed(index), fetch)  # any order: the reader sorts by start
    assert (reader.keys(), reader.shape("w"), reader.dtype("w")) == (["w"], (2, 11), torch.float64)
    for want in _saved(22, read_world):
        got = reader.read("w", want.start, want.end)
        assert torch.equal(got, want.of_full(full))
    assert torch.equal(reader.full("w"), full)
    fetched.clear()
    reader.read("w", 0, 1)
    assert fetched == ([] if saved_world == 1 else ["rank0"])  # one source, the last cached


def test_a_reader_names_a_missing_key_and_a_range_outside_the_tensor() -> None:
    reader = PieceReader([(Piece("w", (4,), 0, 4), "float32", "f", "x")], lambda s: {})
    with pytest.raises(KeyError, match="no tensor 'v'"):
        reader.read("v", 0, 1)
    with pytest.raises(ValueError, match=r"range 2:5 is outside 'w' of 4 elements"):
        reader.read("w", 2, 5)


def _phalanx_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phalanx"):
            names.append(node.module or "")
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("phalanx")]
    return names


def test_the_record_module_depends_on_nothing_else_in_phalanx() -> None:
    src = Path(phalanx.__file__).parent
    assert _phalanx_imports(src / "sharding" / "pieces.py") == []
