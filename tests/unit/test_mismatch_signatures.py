"""The always-on check's pure parts: rolling CRCs, published windows, the comparison."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from phalanx.diagnostics.flight import FlightRecorder
from phalanx.diagnostics.mismatch_check import Checker, compare, neighbours
from phalanx.diagnostics.snapshot import parse_progress

Call = tuple[str, str, str, str]  # op, shape, args, site


def _rank(rank: int, calls: list[Call]) -> tuple[Checker, FlightRecorder]:
    check, rec = Checker(rank, sites=True), FlightRecorder()
    for seq, (op, shape, args, site) in enumerate(calls, 1):
        rec.start("0", seq, op, shape, site, args=args)
        check.note("0", seq, op, shape, args)
    return check, rec


def _snapshot(check: Checker, rec: FlightRecorder, seq: int) -> dict[str, list[Any]]:
    snap: dict[str, list[Any]] = {"0": [seq, "all_reduce"]}
    check.extend(snap, rec)
    return parse_progress(snap)


AR: Call = ("all_reduce", "[4] float32", "SUM", "t.py:3 in step")


def test_equal_calls_have_equal_crcs_and_no_finding() -> None:
    a, ra = _rank(0, [AR] * 5)
    b, rb = _rank(1, [AR] * 5)
    assert a.crc_at("0", 5) == b.crc_at("0", 5) is not None
    assert a.crc_at("0", 6) is None
    mine = {"0": a.windows(ra)["0"]}
    assert a.check(1, _snapshot(b, rb, 5), mine) is None
    assert a.agreed == {"0": 5}


def test_a_reduce_op_mismatch_is_found_and_named() -> None:
    a, ra = _rank(0, [AR] * 3)
    b, rb = _rank(1, [AR, AR, ("all_reduce", "[4] float32", "MAX", AR[3])])
    text = a.check(1, _snapshot(b, rb, 3), {"0": a.windows(ra)["0"]})
    assert text is not None and "collective #3 on group 0 diverges" in text
    assert "rank(s) [1] issued all_reduce [4] float32 MAX" in text


def test_a_difference_older_than_the_window_is_still_found() -> None:
    a, ra = _rank(0, [AR] * 100)
    b, rb = _rank(1, [("broadcast", "[4] float32", "root=0", "x")] + [AR] * 99)
    text = a.check(1, _snapshot(b, rb, 100), {"0": a.windows(ra)["0"]})
    assert text is not None and "on group 0 differ between #1 and #100" in text


def test_a_peer_ahead_is_left_to_compare_with_us() -> None:
    a, ra = _rank(0, [AR] * 3)
    b, rb = _rank(1, [AR] * 3 + [("barrier", "-", "", "y")])
    assert a.check(1, _snapshot(b, rb, 4), {"0": a.windows(ra)["0"]}) is None


def test_a_skip_with_equal_signatures_is_warned_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, ra = _rank(0, [AR, (*AR[:3], "t.py:9 in extra"), AR, AR])
    b, rb = _rank(1, [AR, AR, AR])
    with caplog.at_level(logging.WARNING):
        assert a.check(1, _snapshot(b, rb, 3), {"0": a.windows(ra)["0"]}) is None
    assert "rank(s) [1] skipped all_reduce [4] float32 SUM at t.py:9 in extra" in caplog.text
    assert "PHALANX_CALL_SITES=0" in caplog.text


def test_compare_reports_the_first_differing_crc() -> None:
    a, ra = _rank(0, [AR] * 4)
    b, rb = _rank(1, [AR, AR, ("all_gather", "[4] float32", "", AR[3]), AR])
    cmp = compare("0", a.windows(ra)["0"], b.windows(rb)["0"], (0, 1), True)
    assert cmp.differing == 3 and cmp.start == 1
    assert cmp.divergence is not None and cmp.divergence.seq == 3


def test_neighbours_cover_every_group_in_a_ring() -> None:
    assert neighbours(0, [[0, 1]]) == [1]
    assert neighbours(2, [[0, 1, 2, 3], [2, 6]]) == [1, 3, 6]
    assert neighbours(0, [[0]]) == []


def test_malformed_snapshots_are_refused() -> None:
    with pytest.raises(TypeError):
        parse_progress({"0": [1, "x", 2]})
    with pytest.raises(TypeError):
        parse_progress([1])
