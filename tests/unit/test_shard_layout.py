"""The pure ZeRO-1/2 layout: buckets, balanced per-rank ranges and staging segments."""

from __future__ import annotations

import pytest

from phalanx.sharding.layout import plan_shards


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("cap_bytes", [16, 100, 1 << 20])
def test_every_element_is_owned_once_and_lands_in_its_ranks_staging_slot(
    world: int, cap_bytes: int
) -> None:
    groups = [[70, 7, 21, 3], [5, 1, 40]]
    layout = plan_shards(groups, world, 4, cap_bytes)
    assert layout.total == sum(map(sum, groups))
    seen = {i: [0] * n for i, n in enumerate(layout.numels)}
    flat_end = 0
    for b in layout.buckets:
        assert b.flat_offset == flat_end  # buckets lie end to end
        flat_end += b.numel
        sizes = [e - s for s, e in b.part.bounds]
        assert max(sizes) - min(sizes) <= 1  # balanced
        slots = set()
        for seg in b.segments:
            s, e = b.part.bounds[seg.rank]
            piece = seg.piece
            assert piece.key == f"param{seg.param}" and piece.shape == (layout.numels[seg.param],)
            slot = range(piece.offset, piece.offset + piece.numel)
            assert seg.rank * b.chunk <= slot.start and slot.stop <= seg.rank * b.chunk + e - s
            assert not slots & set(slot)
            slots |= set(slot)
            for k in range(piece.start, piece.end):
                seen[seg.param][k] += 1
    assert flat_end == layout.total
    assert all(c == 1 for counts in seen.values() for c in counts)


def test_buckets_never_mix_groups_and_hold_the_last_parameters_first() -> None:
    layout = plan_shards([[10, 10], [10, 10]], 2, 4, 1 << 20)
    assert [(b.group, b.params) for b in layout.buckets] == [(0, (1, 0)), (1, (3, 2))]
    assert layout.param_offset(1) == 0 and layout.param_offset(0) == 10


def test_bad_world_is_named() -> None:
    with pytest.raises(ValueError, match="world must be >= 1, got 0"):
        plan_shards([[3]], 0, 4, 16)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_extra_elements_rotate_so_every_ranks_total_is_within_one(world: int) -> None:
    # Buckets of 7, 7, 7, 3 elements: each uneven; the extra element must not always go to rank 0.
    layout = plan_shards([[7], [7], [7], [3]], world, 4, 1 << 20)
    totals = [0] * world
    for b in layout.buckets:
        for r, (s, e) in enumerate(b.part.bounds):
            totals[r] += e - s
    assert sum(totals) == 24
    assert max(totals) - min(totals) <= 1, totals


def test_registration_order_when_not_reversed() -> None:
    layout = plan_shards([[10, 10], [10, 10]], 2, 4, 1 << 20, reverse=False)
    assert [(b.group, b.params) for b in layout.buckets] == [(0, (0, 1)), (1, (2, 3))]
    assert layout.buckets[0].part.bounds == ((0, 10), (10, 20))  # rank 0 owns parameter 0


def test_flags_follow_each_ranks_range_in_its_chunk() -> None:
    layout = plan_shards([[5, 2]], 2, 4, 1 << 20, flags=True)
    (b,) = layout.buckets
    assert b.flags == 2 and b.flag_offset == b.part.chunk == 4 and b.chunk == 6
    for seg in b.segments:  # data stays before the flags of the rank's chunk
        start = seg.piece.offset - seg.rank * b.chunk
        assert start >= 0 and start + seg.piece.numel <= b.flag_offset


def test_copy_runs_are_the_segments_pieces_as_slices() -> None:
    layout = plan_shards([[5, 2]], 2, 4, 1 << 20, flags=True)
    (b,) = layout.buckets
    runs = b.copy_runs()
    assert len(runs) == len(b.segments)
    for (param, held, elements), seg in zip(runs, b.segments):
        assert param == seg.param
        assert (held.start, held.stop) == (seg.piece.offset, seg.piece.offset + seg.piece.numel)
        assert (elements.start, elements.stop) == (seg.piece.start, seg.piece.end)
