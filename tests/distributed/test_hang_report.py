"""Live hang reports: one incident, one text printed by every live rank, within threshold + 2 s.

Each case is a real hang at ``PHALANX_HANG_TIMEOUT=2``: a rank sleeping in Python, a rank busy in
a native call that holds the GIL (its stack comes from faulthandler), a skipped collective (both
ranks stuck: concurrent requests), and an all-reduce inside ``if rank == 0:``.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.diagnostics import diagnose_cli as diagnose
from phalanx.diagnostics import tracking
from phalanx.testing import run_distributed

THRESHOLD = 2.0
ENV = {"PHALANX_HANG_TIMEOUT": str(THRESHOLD)}


def _printed() -> list[tuple[str, float]]:
    """This rank's reports with the time each was printed."""
    watch = tracking._T.watch  # type: ignore[union-attr]
    assert watch is not None
    return list(zip(watch.reports, watch.printed))


def _sleepy_rank() -> None:
    time.sleep(5.0)  # longer than the threshold + the report's collection


def _native_busy() -> None:
    ctypes.PyDLL(None).sleep(5)  # libc sleep through PyDLL: the GIL stays held for 5 s


def _late(how: str) -> tuple[float, list[tuple[str, float]]]:
    t = torch.ones(3)
    phalanx.all_reduce(t)
    t0 = time.time()  # both ranks leave collective #1 together
    if dist.get_rank() == 1:
        _sleepy_rank() if how == "python" else _native_busy()
    phalanx.all_reduce(t)
    return t0, _printed()


def _same_report_in_time(results: list[tuple[float, list[tuple[str, float]]]]) -> str:
    live = [printed for _, printed in results if printed]
    texts = {text for printed in live for text, _ in printed}
    assert len(texts) == 1, texts  # one incident, the same text on every rank that printed
    for t0, printed in results:
        for _, when in printed:
            assert when - t0 < THRESHOLD + 2.0, when - t0
    return texts.pop()


def test_a_rank_sleeping_in_python() -> None:
    results = run_distributed(_late, "python", world_size=2, timeout=60, env=ENV)
    assert results[0][1] and results[1][1]  # printed by both ranks, while rank 1 still slept
    text = _same_report_in_time(results)
    assert text.startswith("phalanx hang report #1 (opened by rank 0): rank 0 has waited 2.")
    assert "all_reduce [3] float32 SUM at" in text and "(collective #2 on group 0)" in text
    assert "Rank(s) [1] never reached it." in text
    assert "rank 1: last completed collective: all_reduce [3] float32 SUM" in text
    assert "in _sleepy_rank" in text and "time.sleep(5.0)" in text
    assert "did not answer" not in text


def test_a_rank_holding_the_gil_in_native_code() -> None:
    results = run_distributed(_late, "native", world_size=2, timeout=60, env=ENV)
    assert results[0][1] and not results[1][1]  # rank 1 could not run while it held the GIL
    text = _same_report_in_time(results)
    assert "Rank(s) [1] never reached it." in text
    assert "rank 1 (host" in text and "did not answer" in text and "the GIL is held" in text
    assert "rank 1 main thread (faulthandler, most recent call first):" in text
    assert "in _native_busy" in text  # the stack faulthandler wrote without the GIL


def _log_metrics(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)  # a collective only rank 0 issues: the classic divergence


def _train_step(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)


def _diverge() -> tuple[float, list[tuple[str, float]]]:
    t = torch.ones(2)
    t0 = 0.0
    for step in range(3):
        if dist.get_rank() == 0 and step == 1:
            _log_metrics(t)
        _train_step(t)
        t0 = time.time()
    if dist.get_rank() == 1:
        time.sleep(4.5)  # rank 0 is one collective ahead and waits: the watchdog reports
        phalanx.all_reduce(t)  # then release it
    return t0, _printed()


def test_all_reduce_inside_if_rank_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {**ENV, "PHALANX_DUMP_DIR": str(tmp_path)}
    results = run_distributed(_diverge, world_size=2, timeout=60, env=env)
    text = _same_report_in_time(results)
    assert "rank 0 has waited 2." in text and "in _train_step (collective #4 on group 0)" in text
    assert "Rank(s) [1] never reached it." in text
    div = text.split("First divergence: ")[1]
    assert div.startswith("collective #2 on group 0 diverges")
    assert "rank(s) [0] issued all_reduce [2] float32 SUM at" in div and "in _log_metrics" in div
    assert "rank(s) [1] issued all_reduce [2] float32 SUM at" in div and "in _train_step" in div
    assert "rank(s) [1] skipped all_reduce [2] float32 SUM at" in div
    # The same from the dumps, after the fact: `phalanx diagnose DIR`.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]
    capsys.readouterr()
    assert diagnose.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: collective #2 on group 0" in out and "in _log_metrics" in out


def _skip() -> tuple[float, list[tuple[str, float]], str]:
    t = torch.ones(4)
    phalanx.all_reduce(t)
    t0 = time.time()
    try:
        if dist.get_rank() != 1:
            phalanx.all_reduce(t)  # rank 1 skips this one ...
        phalanx.barrier()  # ... and meets it with a barrier: both ranks wait, both request
    except phalanx.CollectiveError as exc:
        return t0, _printed(), f"{type(exc).__name__}: {exc}"
    return t0, _printed(), ""


def test_a_skipped_collective_both_ranks_stuck_one_report() -> None:
    results = run_distributed(_skip, world_size=2, timeout=60, env=ENV, collective_timeout=5)
    printed = [r[:2] for r in results]
    assert len(printed[0][1]) == len(printed[1][1]) == 1  # one incident, not one per requester
    text = _same_report_in_time(printed)
    assert "did not answer" not in text  # nobody called silent
    assert "has waited 2." in text and "Also waiting: rank " in text
    assert "all_reduce [4] float32 SUM" in text and "barrier - at" in text
    assert "First divergence: collective #2 on group 0 diverges" in text
    assert "(differing: op, shape/dtype, reduce op/root)" in text
    assert "rank 0 main thread stack" in text and "rank 1 main thread stack" in text
    for _, _, error in results:  # and when gloo gives up, both raise the mismatch
        assert error.startswith("CollectiveMismatchError") and "diverges" in error
