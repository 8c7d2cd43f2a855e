"""Live hang reports: the lagging rank, its stack, and where ranks' code paths diverge."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.comm import diagnose_cli as diagnose
from phalanx.comm import tracking
from phalanx.testing import run_distributed

ENV = {"PHALANX_HANG_TIMEOUT": "1.5"}


def _sleepy_rank() -> None:
    time.sleep(5.0)  # longer than the hang threshold + the report's collection


def _hang() -> list[str]:
    t = torch.ones(3)
    phalanx.all_reduce(t)
    if dist.get_rank() == 1:
        _sleepy_rank()
    phalanx.all_reduce(t)
    return tracking.hang_reports()


def test_hang_report_names_the_late_rank_and_its_stack() -> None:
    start = time.monotonic()
    reports = run_distributed(_hang, world_size=2, timeout=60, env=ENV)
    assert time.monotonic() - start < 30
    assert reports[0] and reports[1]  # printed by every rank, while rank 1 was still asleep
    text = reports[0][0]
    assert "rank 0 has waited" in text and "all_reduce [3] float32" in text
    assert "Rank(s) [1] never reached it." in text
    assert "rank 1: last completed collective: all_reduce [3] float32" in text
    assert "in _sleepy_rank" in text and "time.sleep(5.0)" in text


def _log_metrics(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)  # a collective only rank 0 issues: the classic divergence


def _train_step(t: torch.Tensor) -> None:
    phalanx.all_reduce(t)


def _diverge() -> list[str]:
    t = torch.ones(2)
    for step in range(3):
        if dist.get_rank() == 0 and step == 1:
            _log_metrics(t)
        _train_step(t)
    if dist.get_rank() == 1:
        time.sleep(4.0)  # rank 0 is one collective ahead and waits: the watchdog reports
        phalanx.all_reduce(t)  # then release it
    return tracking.hang_reports()


def test_divergent_collective_names_ranks_and_call_sites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**ENV, "PHALANX_DUMP_DIR": str(tmp_path)}
    reports = run_distributed(_diverge, world_size=2, timeout=60, env=env)
    text = reports[0][0]
    div = text.split("First divergence: ")[1]
    assert div.startswith("collective #2 on group")
    assert "rank(s) [0] issued all_reduce [2] float32 at" in div and "in _log_metrics" in div
    assert "rank(s) [1] issued all_reduce [2] float32 at" in div and "in _train_step" in div
    # The same from the dumps, after the fact: `phalanx diagnose DIR`.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]
    capsys.readouterr()
    assert diagnose.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: collective #2 on group" in out and "in _log_metrics" in out
