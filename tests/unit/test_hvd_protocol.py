"""phalanx.horovod's negotiation protocol: rows round-trip, and every round's decision."""

from __future__ import annotations

import pytest

from phalanx.horovod.protocol import (
    PAYLOAD_SLOTS,
    PENDING_SLOTS,
    Kind,
    Row,
    State,
    decide,
    decode_rows,
    encode_row,
    stable_hash,
)
from phalanx.horovod.requests import mismatch, signature

A, B, C = (stable_hash(f"allreduce.{n}") for n in "abc")


def _row(state: State, name: int = 0, pending: tuple[int, ...] = (), rounds: int = 0) -> Row:
    return Row(state, int(Kind.ALLREDUCE), name, 7, rounds, pending, len(pending), (3,))


def test_rows_round_trip_and_cut_long_lists() -> None:
    row = Row(State.WAIT, 3, A, B, 2, (A, B), 2, (17, 32))
    assert decode_rows([encode_row(row)]) == [row]
    long = Row(State.ASYNC, 3, A, B, 0, tuple(range(1, 12)), 11, tuple(range(PAYLOAD_SLOTS + 1)))
    (back,) = decode_rows([encode_row(long)])
    assert back.pending == tuple(range(1, PENDING_SLOTS + 1)) and back.n_pending == 11
    assert back.payload is None  # did not fit: the controller exchanges descriptions
    assert stable_hash("x") == stable_hash("x") != stable_hash("y")
    assert 0 <= stable_hash("x") < 2**63


def test_same_current_request_everywhere_runs_on_the_fast_path() -> None:
    plan = decide([_row(State.BLOCKING, A), _row(State.ASYNC, A)])
    assert plan.ready == (A,) and plan.fast == A and not plan.deferred and not plan.stuck


def test_async_request_others_lack_is_deferred_then_matched_by_name() -> None:
    # rank 0 starts 'a' asynchronously while rank 1 is in a barrier-like blocking request 'b'
    plan = decide([_row(State.ASYNC, A), _row(State.BLOCKING, B)])
    assert plan.ready == () and plan.deferred == {0} and not plan.stuck
    # later rank 0 reaches 'b' with 'a' deferred; only 'b' runs
    plan = decide([_row(State.BLOCKING, B, (A,)), _row(State.BLOCKING, B)])
    assert plan.ready == (B,) and plan.fast == B
    # rank 1 issues 'a': it matches rank 0's deferred 'a' (checked by descriptions, not rows)
    plan = decide([_row(State.BLOCKING, C, (A,)), _row(State.ASYNC, A)])
    assert plan.ready == (A,) and plan.fast is None and not plan.deferred


def test_ready_requests_run_in_the_first_active_ranks_issue_order() -> None:
    rows = [_row(State.ASYNC, B, (A,)), _row(State.ASYNC, A, (B,))]
    assert decide(rows).ready == (A, B)


def test_waiting_for_what_nobody_else_issues_is_stuck() -> None:
    plan = decide([_row(State.BLOCKING, A), _row(State.BLOCKING, B)])
    assert plan.stuck and plan.ready == ()
    plan = decide([_row(State.WAIT, A, (A,)), _row(State.BLOCKING, B)])
    assert plan.stuck


def test_joined_ranks_do_not_block_and_the_last_to_join_is_named() -> None:
    plan = decide([_row(State.JOINED, rounds=3), _row(State.BLOCKING, A)])
    assert plan.ready == (A,) and plan.fast is None and not plan.finished
    plan = decide([_row(State.JOINED, rounds=4), _row(State.JOINED, rounds=0)])
    assert plan.finished and plan.last_joined == 1
    plan = decide([_row(State.JOINED), _row(State.JOINED), _row(State.JOINED, rounds=1)])
    assert plan.last_joined == 1  # a tie: the highest rank among the last


def test_full_pending_lists_replace_cut_ones() -> None:
    rows = [_row(State.BLOCKING, C, (A,)), _row(State.BLOCKING, C)]
    assert decide(rows, pending=[(A, B), (B,)]).ready == (B, C)


def _desc(dtype: str, shape: list[int], **kw: object) -> dict[str, object]:
    base = {
        "kind": int(Kind.ALLREDUCE),
        "key": "allreduce.x",
        "tensors": [[dtype, shape, "cpu"]],
        "root": -1,
        "op": 1,
        "pre": 1.0,
        "post": 1.0,
        "payload": [],
        "free": False,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (_desc("float32", [2, 4]), ["mismatched tensor shapes", "rank 1 sent float32 [2, 4]"]),
        (_desc("int32", [2, 3]), ["mismatched data types", "rank 0 sent float32"]),
        (_desc("float32", [2, 3], root=1), ["mismatched root ranks", "rank 1 named root 1"]),
        (_desc("float32", [2, 3], op=4), ["mismatched reduction", "rank 1 asked for op hvd.Max"]),
        (_desc("float32", [2, 3], kind=int(Kind.ALLGATHER)), ["mismatched operations"]),
    ],
)
def test_mismatches_name_what_differs_and_every_rank(other: dict, words: list[str]) -> None:
    mine = _desc("float32", [2, 3])
    assert mismatch({0: mine, 1: mine}) is None
    message = mismatch({0: mine, 1: other})
    assert message is not None
    for w in words:
        assert w in message, message
    assert signature(mine) != signature(other)


def test_gather_signatures_ignore_the_first_dimension() -> None:
    a = _desc("float32", [2, 3], free=True)
    b = _desc("float32", [5, 3], free=True)
    assert signature(a) == signature(b) and mismatch({0: a, 1: b}) is None
    c = _desc("float32", [5, 4], free=True)
    assert "rank 1 sent float32 [*, 4]" in str(mismatch({0: a, 1: c}))
