"""The flight recorder's ring and the pure divergence finder."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.diagnostics import diagnose_cli as diagnose
from phalanx.diagnostics.flight import FlightRecorder, Record, load_dump
from phalanx.diagnostics.pairing import first_divergence


def _rec(seq: int, site: str = "t.py:1 in f", op: str = "all_reduce", g: str = "0") -> Record:
    return Record(g, seq, op, "[2] float32", site, float(seq), float(seq) + 0.1)


def test_ring_keeps_the_last_records_and_tracks_in_flight() -> None:
    fr = FlightRecorder(capacity=3)
    for seq in range(1, 6):
        fr.start("0", seq, "all_reduce", "[2]", "x.py:1")
        if seq != 4:
            fr.finish("0", seq)
    assert [r.seq for r in fr.records()] == [3, 4, 5]
    stuck = fr.in_flight()
    assert stuck is not None and stuck.seq == 4


def test_same_records_do_not_diverge() -> None:
    recs = [_rec(1), _rec(2)]
    assert first_divergence({0: recs, 1: list(recs)}) is None


def test_a_skipped_call_shows_as_a_shift_to_the_next_call() -> None:
    a = [_rec(1), _rec(2, "t.py:9 in log"), _rec(3)]
    b = [_rec(1), _rec(2), _rec(3)]
    div = first_divergence({0: a, 1: b})
    assert div is not None and div.seq == 2 and div.skipped and div.ahead == (1,)
    text = div.describe()
    assert "rank(s) [0] issued all_reduce [2] float32 at t.py:9 in log" in text
    assert "rank(s) [1] issued all_reduce [2] float32 at t.py:1 in f" in text
    assert "rank(s) [1] skipped all_reduce [2] float32 at t.py:9 in log" in text


def test_a_rank_at_an_earlier_step_has_not_diverged() -> None:
    # issue 15: two healthy ranks at different steps were called "diverged".
    assert first_divergence({0: [_rec(1), _rec(2), _rec(3)], 1: [_rec(1)]}) is None


def test_forgotten_records_are_not_compared() -> None:
    # rank 0's ring dropped seq 1; seq 1 is not reported as missing on rank 0.
    assert first_divergence({0: [_rec(2)], 1: [_rec(1), _rec(2)]}) is None


def test_diagnose_says_where_records_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for rank, n in ((0, 3), (1, 2)):
        fr = FlightRecorder()
        for seq in range(1, n + 1):
            fr.start("0", seq, "all_reduce", "[2] float32", "a.py:3 in g", args="SUM")
            fr.finish("0", seq)
        fr.dump(tmp_path / f"rank-{rank}.json", rank)
    assert diagnose.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 1: 2 collectives recorded; last: all_reduce [2] float32 SUM at a.py:3" in out
    assert "group 0: rank(s) [1] stop before #3, which rank(s) [0] issued" in out
    assert "no divergence" in out


def test_dump_round_trip_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):
        fr = FlightRecorder()
        fr.start("0", 1, "broadcast", "[4]", "a.py:3 in g")
        fr.finish("0", 1)
        fr.dump(tmp_path / f"rank-{rank}.json", rank)
    rank, recs = load_dump(tmp_path / "rank-1.json")
    assert rank == 1 and recs[0].op == "broadcast" and recs[0].end is not None
    assert diagnose.main([str(tmp_path)]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert diagnose.main([str(tmp_path / "nothing")]) == 2


def test_p2p_records_show_their_peer_and_idle_ones_are_not_in_flight() -> None:
    fr = FlightRecorder()
    fr.start("p2p", 1, "recv", "[4] float32", "s.py:3 in serve", peer=-1, idle=True)
    assert fr.in_flight() is None  # an idle wait is never a hang
    fr.start("p2p", 2, "recv", "[4] float32", "p.py:9 in stage", peer=0)
    stuck = fr.in_flight()
    assert stuck is not None and stuck.where() == "recv [4] float32 from rank 0 at p.py:9 in stage"
    assert fr.records()[0].where() == "recv [4] float32 from any rank at s.py:3 in serve"


def test_stopping_tracking_forgets_what_was_in_flight() -> None:
    from phalanx.diagnostics import tracking

    tracking._RECORDER.start("0", 7, "all_reduce", "[2]", "x.py:1")
    tracking.stop()  # destroy_process_group: a later group must not inherit this wait
    assert tracking._RECORDER.in_flight() is None
    assert tracking._RECORDER.records()[-1].end is None  # still in the ring, never completed
