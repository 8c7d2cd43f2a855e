"""The hang report's text: built from the incident and the answers only (pure)."""

from __future__ import annotations

import time

import pytest

from phalanx.diagnostics import hang_report
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.hang_report import Answer, Incident, Silent, build_report


def _rec(seq: int, site: str = "t.py:5 in step", start: float = 100.0, done: bool = True) -> Record:
    return Record(
        "0",
        seq,
        "all_reduce",
        "[3] float32",
        site,
        start,
        start + 0.1 if done else None,
        args="SUM",
    )


def _case() -> tuple[Incident, dict[int, Answer], dict[int, Silent]]:
    stuck = _rec(2, start=100.0, done=False)
    inc = Incident(1, 0, 102.5, stuck)
    answers = {
        0: Answer(102.6, stuck, ['  File "t.py", line 5, in step\n'], [_rec(1), stuck]),
        1: Answer(103.0, None, ['  File "t.py", line 9, in load\n    sleep()\n'], [_rec(1)]),
    }
    return inc, answers, {}


def test_the_text_depends_only_on_its_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    inc, answers, silent = _case()
    first = build_report(inc, answers, silent)
    monkeypatch.setattr(time, "time", lambda: 10_000.0)  # another printer, later
    assert build_report(inc, answers, silent) == first
    assert first.startswith(
        "phalanx hang report #1 (opened by rank 0): rank 0 has waited 2.5 s in "
        "all_reduce [3] float32 SUM at t.py:5 in step (collective #2 on group 0)."
    )
    assert "printed by" not in first


def test_ranks_behind_get_their_last_call_and_stack() -> None:
    text = build_report(*_case())
    assert "Rank(s) [1] never reached it." in text
    assert (
        "rank 1: last completed collective: all_reduce [3] float32 SUM at t.py:5 in step (#1)"
        in text
    )
    assert "rank 1 main thread stack (most recent call last):" in text and "in load" in text
    assert "did not answer" not in text and "First divergence" not in text


def test_other_waiting_ranks_are_listed_with_their_own_clock() -> None:
    inc, answers, silent = _case()
    other = _rec(2, "t.py:7 in barrier_site", start=101.0, done=False)
    answers[1] = Answer(103.0, other, ["x\n"], [_rec(1), other])
    text = build_report(inc, answers, silent)
    assert "Also waiting: rank 1 has waited 2.0 s in all_reduce [3] float32 SUM at t.py:7" in text


def test_identical_stacks_are_printed_once() -> None:
    inc, answers, _ = _case()
    for r in (1, 2, 3):
        answers[r] = Answer(103.0, None, ["same\n"], [_rec(1)])
    text = build_report(inc, answers, {})
    assert "ranks [1, 2, 3] main thread stack (most recent call last):" in text


def test_silent_ranks_come_with_their_evidence() -> None:
    inc, answers, _ = _case()
    del answers[1]
    silent = {
        1: Silent(
            ["rank 1 (host h, pid 7) did not answer: its progress thread has not run"],
            [_rec(1)],
            ['File "t.py", line 3 in native'],
        )
    }
    text = build_report(inc, answers, silent)
    assert "Rank(s) [1] never reached it." in text  # from its call ring
    assert "rank 1 main thread (faulthandler, most recent call first):" in text
    assert '  File "t.py", line 3 in native' in text


def test_too_many_distinct_stacks_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hang_report, "MAX_STACKS", 2)
    inc, answers, _ = _case()
    for r in (1, 2, 3):
        answers[r] = Answer(103.0, None, [f"stack {r}\n"], [_rec(1)])
    assert "(1 more distinct stacks left out)" in build_report(inc, answers, {})


def test_a_silent_machine_is_named_as_maybe_cut_off() -> None:
    """Issue 35, point 7: after a cut link, no rank of the other machine can answer; the
    report names the link beside the other causes."""
    inc, answers, _ = _case()
    answers[0] = Answer(102.6, inc.stuck, ["x\n"], [_rec(1), inc.stuck], host="mh0")
    del answers[1]
    lines = ["rank {} (host mh1, 10.0.0.2, pid 7) did not answer (dead, or stuck ...)"]
    silent = {r: Silent([lines[0].format(r)], elsewhere=("mh1", "10.0.0.2")) for r in (1, 2)}
    silent[3] = Silent(["rank 3 (host mh2, pid 9) did not answer"], elsewhere=("mh2", ""))
    text = build_report(inc, answers, silent)
    assert (
        "No rank on host mh1 (10.0.0.2) answered (rank(s) [1, 2], on another machine than the "
        "reporting rank): the network link to mh1 may be down or partitioned, besides those "
        "ranks being dead or stuck; check that this machine reaches 10.0.0.2 and that they "
        "still run."
    ) in text
    assert "No rank on host mh2 answered (rank(s) [3]" in text and "reaches mh2 and" in text
    assert "rank 1 (host mh1, 10.0.0.2, pid 7) did not answer" in text  # the other causes stay


def test_no_link_is_blamed_on_this_machine_or_where_a_rank_answered() -> None:
    inc, answers, _ = _case()
    answers[1] = Answer(103.0, None, ["x\n"], [_rec(1)], host="mh1")  # mh1 reached the store
    silent = {
        2: Silent(["rank 2 did not answer"], elsewhere=("mh1", "10.0.0.2")),
        3: Silent(["rank 3 is dead, killed by SIGKILL."]),  # on the reporter's machine
    }
    assert "network link" not in build_report(inc, answers, silent)
