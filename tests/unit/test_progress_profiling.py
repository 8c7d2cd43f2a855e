"""Rank-0 progress bar and the per-rank profiler trace, in one process."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.train.profiling import profile
from phalanx.train.progress import progress


def test_progress_enabled_draws_and_yields_everything(capsys) -> None:  # type: ignore[no-untyped-def]
    bar = progress(range(7), desc="epoch 0", enabled=True)
    assert bar.enabled and len(bar) == 7
    seen = []
    for i in bar:
        seen.append(i)
        bar.set_metrics(loss=1.0 / (i + 1), samples_per_s=812)
    assert seen == list(range(7))
    err = capsys.readouterr().err
    assert "epoch 0" in err and "7/7" in err and "loss=0.1429" in err  # the last value shown


def test_progress_disabled_is_a_passthrough(capsys) -> None:  # type: ignore[no-untyped-def]
    bar = progress(iter(range(5)), enabled=False, total=5)
    assert not bar.enabled and len(bar) == 5
    out = []
    for i in bar:
        bar.set_metrics(loss=0.5)
        out.append(i)
    assert out == list(range(5))
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_progress_default_is_rank_zero(capsys) -> None:  # type: ignore[no-untyped-def]
    assert progress([1, 2]).enabled  # a single process is rank 0
    capsys.readouterr()


def _train_steps(prof, n: int) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    for _ in range(n):
        model(x).sum().backward()
        prof.step()


def test_profile_writes_one_chrome_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with profile(tmp_path / "traces", steps=2, warmup=1, wait=1) as prof:
        _train_steps(prof, 6)
        assert prof.written  # switched itself off after the active steps
    assert prof.path == tmp_path / "traces" / "rank0.pt.trace.json"
    trace = json.loads(prof.path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert names & {"aten::linear", "aten::addmm"}


def test_profile_without_with_and_early_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prof = profile(tmp_path, steps=50, warmup=1, wait=0)
    _train_steps(prof, 3)  # fewer than the schedule's steps
    assert not prof.written
    prof.stop()
    assert prof.written and json.loads(prof.path.read_text())["traceEvents"]  # type: ignore[union-attr]


def test_profile_none_is_a_no_op(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with profile(None) as prof:
        _train_steps(prof, 3)
    assert prof.path is None and not prof.written and prof._prof is None


def test_profile_rejects_bad_schedule() -> None:
    with pytest.raises(ValueError, match="steps=0"):
        profile("x", steps=0)
