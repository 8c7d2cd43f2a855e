"""Mismatched collectives without ``PHALANX_DEBUG``: named on every surviving rank, right blame.

gloo aborts one rank on a shape or dtype mismatch (SIGABRT): the survivor names it, its signal,
the collective it had entered and both calls (from its call ring). An op, root or skipped
collective hangs gloo: the always-on check names it within about a second (``mismatch_found``)
and the stuck collective fails with it. A reduce-op mismatch completes with wrong numbers: the
check raises it at a later collective. The seeds' rank-dependent ``scatter`` passes.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.diagnostics import tracking
from phalanx.testing import run_distributed, scaled

Outcome = tuple[str, str, float, float | None]
"""(error type, message, seconds to the error, seconds until the check's finding)."""


def _watch_finding(t0: float, seen: list[float]) -> None:
    while not seen and time.monotonic() - t0 < 30:
        if tracking.mismatch_found() is not None:
            seen.append(time.monotonic() - t0)
        time.sleep(0.02)


def _extra(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)  # only rank 0 calls this


def _common(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)


def _body(kind: str, rank: int) -> None:
    t = torch.ones(4)
    if kind == "shape":
        phalanx.all_reduce(torch.ones(4 if rank == 0 else 8))
    elif kind == "dtype":
        phalanx.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
    elif kind == "op":
        if rank == 0:
            phalanx.all_reduce(t)
        else:
            phalanx.broadcast(t, src=0)
    elif kind == "root":
        phalanx.broadcast(t, src=rank)
    elif kind == "reduce_op":
        for _ in range(2000):  # completes, with wrong numbers: raised at a later collective
            phalanx.all_reduce(t, phalanx.ReduceOp.SUM if rank == 0 else phalanx.ReduceOp.MAX)
            time.sleep(0.002)
    elif kind == "skip":
        if rank == 0:
            _extra(t)  # paired with rank 1's _common: same signature, wrong results
        _common(t)  # rank 0's meets rank 1's barrier: that one hangs
        phalanx.barrier()


def _mismatch(kind: str) -> Outcome:
    rank = phalanx.world().rank
    phalanx.all_reduce(torch.ones(4))  # collective #1, the same everywhere
    t0 = time.monotonic()
    seen: list[float] = []
    threading.Thread(target=_watch_finding, args=(t0, seen), daemon=True).start()
    try:
        _body(kind, rank)
    except phalanx.CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, seen[0] if seen else None
    return "", "", time.monotonic() - t0, seen[0] if seen else None


def _survivors(kind: str, env: dict[str, str] | None = None) -> dict[int, Outcome]:
    results = run_distributed(
        _mismatch, kind, world_size=2, timeout=60, collective_timeout=4, may_die=(0, 1), env=env
    )
    return {r: out for r, out in enumerate(results) if out is not None}


@pytest.mark.parametrize(("kind", "shown"), [("shape", "[8] float32"), ("dtype", "float64")])
def test_gloo_abort_names_the_dead_rank_its_signal_and_both_calls(kind: str, shown: str) -> None:
    alive = _survivors(kind)
    assert len(alive) == 1, alive  # gloo aborted the other rank
    ((me, (name, msg, elapsed, _)),) = alive.items()
    dead = 1 - me
    assert name == "CollectiveMismatchError", msg
    assert f"[rank {me}] all_reduce (collective #2 on group 0) failed" in msg
    assert "collective #2 on group 0 diverges" in msg
    assert "all_reduce [4] float32 SUM" in msg and shown in msg
    assert f"rank {dead} (pid " in msg and "died, killed by SIGABRT, in all_reduce" in msg
    assert "(collective #2, which it had entered)" in msg and "never reached" not in msg
    assert f"rank {dead} main thread at the signal" in msg and "in _body" in msg
    assert elapsed < 3.0


def test_with_the_check_off_the_dead_rank_s_call_ring_still_blames_it() -> None:
    """``PHALANX_MISMATCH_CHECK=0`` stops the comparison, not the call ring (blame's evidence)."""
    alive = _survivors("shape", {"PHALANX_MISMATCH_CHECK": "0"})
    assert len(alive) == 1, alive
    ((me, (name, msg, _, found_after)),) = alive.items()
    dead = 1 - me
    assert name.endswith("Error") and found_after is None, msg  # no check ran
    assert f"rank {dead} (pid " in msg and "died, killed by SIGABRT, in all_reduce" in msg
    assert "(collective #2, which it had entered)" in msg, msg
    assert "never reached" not in msg and "no collective yet" not in msg, msg


@pytest.mark.parametrize(
    ("kind", "needles"),
    [
        (
            "op",
            ["rank(s) [0] issued all_reduce [4] float32 SUM", "rank(s) [1] issued broadcast", "op"],
        ),
        ("root", ["broadcast [4] float32 root=0", "broadcast [4] float32 root=1", "root"]),
        ("skip", ["diverges", "skipped all_reduce", "in _extra", "#2 are wrong"]),
    ],
)
def test_a_hanging_mismatch_is_named_within_a_tick(kind: str, needles: list[str]) -> None:
    alive = _survivors(kind)
    assert sorted(alive) == [0, 1]
    for rank, (name, msg, elapsed, found_after) in alive.items():
        assert name == "CollectiveMismatchError", msg
        assert f"[rank {rank}]" in msg and "phalanx mismatch check:" in msg
        for needle in needles:
            assert needle in msg, (needle, msg)
        assert found_after is not None and found_after < scaled(1.5)  # logged; raised at timeout
        assert elapsed < scaled(8.0)


def test_a_reduce_op_mismatch_is_raised_at_a_later_collective() -> None:
    alive = _survivors("reduce_op")
    assert sorted(alive) == [0, 1]
    for rank, (name, msg, elapsed, _) in alive.items():
        assert name == "CollectiveMismatchError", msg
        assert msg.startswith(f"[rank {rank}] ") and "phalanx mismatch check: collective #" in msg
        assert "all_reduce [4] float32 SUM" in msg and "all_reduce [4] float32 MAX" in msg
        assert "differing: reduce op/root" in msg
        assert elapsed < scaled(2.0)  # a tick (0.5 s) and the comparison, not the gloo timeout


def _scatter_idiom(steps: int) -> list[float]:
    rank = dist.get_rank()
    out = []
    for i in range(steps):
        t = torch.zeros(2)
        if rank == 0:  # the seeds' rank-dependent call sites of one collective
            phalanx.scatter(t, [torch.full((2,), float(i + r)) for r in range(2)], src=0)
        else:
            phalanx.scatter(t, src=0)
        phalanx.all_reduce(t)
        out.append(float(t.sum()))
        time.sleep(0.01)
    assert tracking.mismatch_found() is None
    return out


@pytest.mark.parametrize("validate", [False, True])
def test_rank_dependent_scatter_call_sites_pass(validate: bool) -> None:
    results = run_distributed(_scatter_idiom, 120, world_size=2, validate=validate, timeout=60)
    assert results[0] == results[1] == [2 * (2 * i + 1) for i in range(120)]
