"""Snapshots of sharded state: one buffer per rank, read back as pieces bit for bit (any dtype)."""

from __future__ import annotations

import torch

from phalanx.recovery.shard_snapshot import pack, readers
from phalanx.sharding.pieces import Piece, ShardedState


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _rank_state(rank: int) -> dict[str, ShardedState]:
    """Two old ranks' halves of a 6-element fp32 tensor (one with a NaN payload), a bf16
    tensor, an int64 and a bool scalar only rank 0 holds."""
    nan = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    full = torch.cat([torch.tensor([1.0, -0.0]), nan, torch.tensor([4.0, 5.0, 6.0])])
    half = torch.arange(4, dtype=torch.bfloat16) / 3
    lo, hi = 3 * rank, 3 * rank + 3
    a, b = 2 * rank, 2 * rank + 2
    model = [(Piece("w", (2, 3), lo, hi), full[lo:hi]), (Piece("h", (4,), a, b), half[a:b])]
    optim = [(Piece("w/step", (), 0, 1), torch.tensor([7], dtype=torch.int64))]
    if rank == 0:
        optim.append((Piece("flag:none", (), 0, 1), torch.zeros(1, dtype=torch.bool)))
    return {"model": ShardedState({"rank": rank}, model), "optimizer": ShardedState({}, optim)}


def test_pack_then_read_any_range_bit_exact_across_ranks() -> None:
    snaps = [(r, pack(10, "zero", _rank_state(r))) for r in (1, 0)]
    sections = readers(snaps)
    meta, reader = sections["model"]
    assert meta == {"rank": 0}  # the lowest old rank's
    want = torch.cat([_rank_state(0)["model"].pieces[0][1], _rank_state(1)["model"].pieces[0][1]])
    assert torch.equal(_bits(reader.full("w")), _bits(want.view(2, 3)))  # NaN payload, -0.0
    assert torch.equal(_bits(reader.read("w", 2, 5)), _bits(want[2:5]))  # across two ranks
    assert reader.dtype("h") == torch.bfloat16
    assert torch.equal(reader.full("h"), torch.arange(4, dtype=torch.bfloat16) / 3)
    _, opt = sections["optimizer"]
    assert opt.keys() == ["flag:none", "w/step"]
    assert int(opt.read("w/step", 0, 1)) == 7


def test_pack_reuses_a_buffer_of_the_right_size_only() -> None:
    first = pack(1, "zero", _rank_state(1))
    again = pack(2, "zero", _rank_state(1), reuse=first.buffer)
    assert again.buffer.data_ptr() == first.buffer.data_ptr() and again.step == 2
    other = pack(3, "zero", _rank_state(0), reuse=first.buffer)  # rank 0 holds one more piece
    assert other.buffer.data_ptr() != first.buffer.data_ptr()
    assert other.nbytes > first.nbytes
