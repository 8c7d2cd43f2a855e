"""ZeRO partitions: every element owned exactly once, sizes within one element."""

from __future__ import annotations

import pytest

from phalanx.sharding import partition


def test_every_element_owned_once_and_balanced() -> None:
    for total in range(0, 60):
        for world in range(1, 7):
            p = partition(total, world)
            owned = [i for s, e in p.bounds for i in range(s, e)]
            assert owned == list(range(total))
            sizes = [e - s for s, e in p.bounds]
            assert max(sizes) - min(sizes) <= 1
            assert p.chunk == -(-total // world)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world must be >= 1, got 0"):
        partition(10, 0)


def test_first_says_which_ranks_get_the_extra_elements() -> None:
    sizes = [e - s for s, e in partition(8, 3, first=2).bounds]
    assert sizes == [3, 2, 3]  # ranks 2 and 0 (wrapping around) get the two extra elements
    assert partition(8, 3, first=2).bounds[0] == (0, 3)  # ranges stay in rank order
