"""Pieces of split parameters: the contiguous runs a tensor-parallel slice covers."""

from __future__ import annotations

import torch

from phalanx.mesh.checkpoint import segments_of


def test_a_row_block_is_one_run_and_a_column_block_one_run_per_row() -> None:
    assert segments_of("w", (4, 3), 0, 1, 3) == [("w", (4, 3), 3, 9, 0)]
    assert segments_of("w", (3, 4), 1, 1, 3) == [
        ("w", (3, 4), 1, 3, 0),
        ("w", (3, 4), 5, 7, 2),
        ("w", (3, 4), 9, 11, 4),
    ]


def test_segments_reassemble_the_slice_for_any_dim() -> None:
    full = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    for dim in range(3):
        size = full.shape[dim]
        local = full.narrow(dim, 1, size - 2).contiguous().reshape(-1)
        flat = full.reshape(-1)
        for _, _, a, b, off in segments_of("t", tuple(full.shape), dim, 1, size - 1):
            assert torch.equal(local[off : off + b - a], flat[a:b])
