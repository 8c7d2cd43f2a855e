"""Validation mode and timeout reports: every rank gets an error naming ranks, op and fix."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.testing import run_distributed


def _catch(fn):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn()
    except phalanx.CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _extra() -> None:
    phalanx.all_reduce(torch.ones(4))  # ranks 0 and 2 only


def _common() -> None:
    phalanx.all_reduce(torch.ones(4))


def _mismatch(kind: str):  # type: ignore[no-untyped-def]
    rank = phalanx.world().rank

    def body() -> None:
        if kind == "shape":
            phalanx.all_reduce(torch.ones(4 if rank == 0 else 8))
        elif kind == "dtype":
            phalanx.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
        elif kind == "op":
            if rank == 0:
                phalanx.all_reduce(torch.ones(4))
            else:
                phalanx.broadcast(torch.ones(4), src=0)
        elif kind == "reduce_op":
            phalanx.all_reduce(
                torch.ones(4), phalanx.ReduceOp.SUM if rank == 0 else phalanx.ReduceOp.MAX
            )
        elif kind == "skip":
            phalanx.all_reduce(torch.ones(4))  # collective #1, same everywhere
            if rank != 1:
                phalanx.all_reduce(torch.ones(4))  # rank 1 skips this one ...
            phalanx.barrier()  # ... and meets the others' all_reduce with a barrier
        elif kind == "skip_same_signature":
            phalanx.all_reduce(torch.ones(4))
            if rank != 1:
                _extra()  # rank 1 skips it: its next call has the same signature
            _common()
            _common()

    return _catch(body)


@pytest.mark.parametrize(
    ("kind", "needles"),
    [
        ("shape", ["shape", "[4]", "[8]"]),
        ("dtype", ["dtype", "float32", "float64"]),
        ("op", ["differing: op", "all_reduce", "broadcast", "skipped"]),
        ("reduce_op", ["reduce_op", "SUM", "MAX"]),
        ("skip", ["collective #2", "all_reduce", "barrier", "skipped"]),
        (
            "skip_same_signature",
            [
                "collective #2",
                "rank(s) [1] skipped all_reduce",
                "in _extra",
                "before collective #3",
            ],
        ),
    ],
)
def test_mismatch_raises_on_every_rank_within_2s(kind: str, needles: list[str]) -> None:
    results = run_distributed(_mismatch, kind, world_size=3, validate=True, collective_timeout=30)
    for rank, (name, msg, elapsed) in enumerate(results):
        assert name == "CollectiveMismatchError", (rank, name, msg)
        assert f"[rank {rank}]" in msg
        assert (
            "rank 1" in msg or "ranks [1" in msg or "ranks [0, 2]" in msg or "rank(s) [1" in msg
        ), msg
        assert "test_validation.py" in msg  # the call site
        for needle in needles:
            assert needle in msg, (needle, msg)
        assert elapsed < 2.0, elapsed


def _matching_traffic() -> list[float]:
    out = []
    for i in range(20):
        t = torch.full((3,), float(i))
        phalanx.all_reduce(t)
        phalanx.broadcast(t, src=i % phalanx.world().world_size)
        out.append(float(t.sum()))
    return out


def test_validation_passes_matching_collectives() -> None:
    results = run_distributed(_matching_traffic, world_size=3, validate=True)
    assert results[0] == results[1] == results[2]
    assert results[0][4] == 3 * 3 * 4.0


def _absent_rank(validate: bool, given_up: str):  # type: ignore[no-untyped-def]
    flag = Path(given_up)
    if phalanx.world().rank == 1:  # never reaches the all_reduce before the others give up
        deadline = time.monotonic() + 6
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None, "", 0.0
    result = _catch(lambda: phalanx.all_reduce(torch.ones(4)))
    flag.touch()
    return result


@pytest.mark.parametrize("validate", [False, True])
def test_timeout_names_the_rank_that_never_arrived(validate: bool, tmp_path: Path) -> None:
    given_up = str(tmp_path / "given-up")
    results = run_distributed(
        _absent_rank, validate, given_up, world_size=2, validate=validate, collective_timeout=2
    )
    name, msg, elapsed = results[0]
    assert name == "CollectiveTimeoutError", msg
    assert "all_reduce" in msg and "collective #1" in msg
    assert "rank(s) [1] never reached it" in msg, msg
    assert (
        "rank 1 has issued no collective yet" in msg or "rank 1 reported no collective yet" in msg
    )
    assert elapsed < 6.0
