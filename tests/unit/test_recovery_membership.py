"""Pure membership rules of live recovery: order, parsing, survivors, admission of joiners."""

from __future__ import annotations

import pytest

from phalanx.recovery.membership import (
    Member,
    admissible,
    parse_members,
    slot_order,
    sort_members,
    survivors,
)

A, B, C, D = (Member(f"0.{i}", 0) for i in range(4))


def test_slots_sort_numerically_by_node_then_local_rank() -> None:
    ids = ["1.0", "0.10", "0.9", "0.2"]
    assert sorted(ids, key=slot_order) == ["0.2", "0.9", "0.10", "1.0"]
    assert sort_members([Member("0.1", 3), Member("0.0", 1)]) == [
        Member("0.0", 1),
        Member("0.1", 3),
    ]


def test_parse_members_round_trips_and_refuses_junk() -> None:
    assert parse_members([m.to_json() for m in (A, B)]) == [A, B]
    for bad in ({"0.0": 0}, [["0.0"]], [[0, 0]], [["0.0", -1]], [["0.0", True]], [A.to_json()] * 2):
        with pytest.raises(TypeError):
            parse_members(bad)


def test_survivors_are_the_arrived_members_not_recorded_dead() -> None:
    base = [A, B, C, D]
    assert survivors(base, [D, A, B], {}) == [A, B, D]
    assert survivors(base, [A, B, C, D], {"0.2": 0}) == [A, B, D]
    # a death record of an older incarnation does not cover a replacement
    assert survivors([A, Member("0.2", 1)], [A, Member("0.2", 1)], {"0.2": 0}) == [
        A,
        Member("0.2", 1),
    ]


def test_admissible_admits_new_slots_waits_for_unrecovered_ones_drops_stale() -> None:
    members = [A, B, D]
    replacement, stale, early = Member("0.2", 1), Member("0.1", 0), Member("0.3", 1)
    admit, wait = admissible(members, [replacement, stale, early], {})
    assert admit == [replacement]  # slot 0.2 is free
    assert wait == [early]  # 0.3#0 is still a member: the survivors have not recovered yet
    assert admissible(members, [replacement, Member("0.2", 2)], {}) == ([Member("0.2", 2)], [])
    assert admissible(members, [replacement], {"0.2": 1}) == ([], [])  # it died while waiting
