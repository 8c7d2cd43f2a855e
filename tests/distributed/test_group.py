"""Process-group helpers on real ranks: World, main_first, object collectives, AVG on gloo."""

from __future__ import annotations

import os
import time

import torch

import phalanx
from phalanx.testing import DistributedTestError, run_distributed


def _world_and_main_first(path: str) -> tuple[int, int, bool, bool]:
    w = phalanx.world()
    with phalanx.main_first():
        if w.rank == 0:
            time.sleep(0.3)
            with open(path, "w") as f:
                f.write("prepared")
        saw_file = os.path.exists(path)
    return w.rank, w.world_size, w.is_main, saw_file


def test_world_and_main_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = str(tmp_path / "data.txt")
    results = run_distributed(_world_and_main_first, marker, world_size=3)
    assert results == [(0, 3, True, True), (1, 3, False, True), (2, 3, False, True)]


def _avg_and_async() -> list[float]:
    r = phalanx.world().rank
    t = torch.tensor([float(r), 2.0 * r])
    work = phalanx.all_reduce(t, phalanx.ReduceOp.AVG, async_op=True)
    work.wait()
    return t.tolist()


def test_avg_works_on_gloo_including_async() -> None:
    assert run_distributed(_avg_and_async, world_size=3) == [[1.0, 2.0]] * 3


def _raise_on_rank_1() -> None:
    if phalanx.world().rank == 1:
        raise KeyError("only on rank 1")
    time.sleep(30)


def test_harness_reports_failing_rank_and_kills_peers() -> None:
    start = time.monotonic()
    try:
        run_distributed(_raise_on_rank_1, world_size=3, timeout=30)
    except DistributedTestError as exc:
        assert "rank 1 failed" in str(exc) and "KeyError: 'only on rank 1'" in str(exc)
    else:
        raise AssertionError("no error")
    assert time.monotonic() - start < 10
