"""Pieces of split parameters: the contiguous runs a tensor-parallel slice covers."""

from __future__ import annotations

import torch

from phalanx.sharding.pieces import Piece, slice_pieces


def test_a_row_block_is_one_run_and_a_column_block_one_run_per_row() -> None:
    assert slice_pieces("w", (4, 3), 0, 1, 3) == [Piece("w", (4, 3), 3, 9, 0)]
    assert slice_pieces("w", (3, 4), 1, 1, 3) == [
        Piece("w", (3, 4), 1, 3, 0),
        Piece("w", (3, 4), 5, 7, 2),
        Piece("w", (3, 4), 9, 11, 4),
    ]


def test_pieces_reassemble_the_slice_for_any_dim() -> None:
    full = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    for dim in range(3):
        size = full.shape[dim]
        local = full.narrow(dim, 1, size - 2).contiguous().reshape(-1)
        flat = full.reshape(-1)
        for piece in slice_pieces("t", tuple(full.shape), dim, 1, size - 1):
            assert torch.equal(piece.held_in(local), piece.of_full(flat))
