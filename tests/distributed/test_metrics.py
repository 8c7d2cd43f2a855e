"""MetricsLogger on real ranks: averages in one all-reduce, rank-0 JSONL, errors on every rank."""

from __future__ import annotations

import json
import math

import pytest
import torch

import phalanx
from phalanx.testing import run_distributed
from phalanx.train.metrics import PACKET, MetricsLogger


def _log_two_steps(path: str) -> tuple[dict[str, float], dict[str, float], dict[str, object]]:
    rank = phalanx.world().rank
    phalanx.reset_comm_stats()
    with MetricsLogger(path) as logger:
        first = logger.log(1, loss=float(rank + 1), acc=torch.tensor(0.5 * rank))
        stats = phalanx.comm_stats()
        second = logger.log(2, loss=float(10 * rank))
        logger.log_local(2, lr=0.1)
    return first, second, stats


def test_average_and_jsonl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "sub" / "metrics.jsonl"
    results = run_distributed(_log_two_steps, str(path), world_size=2)
    for first, second, stats in results:
        assert stats == {"all_reduce": (1, PACKET * 8)}  # one packet for the whole call
        assert first == {"acc": 0.25, "loss": 1.5}
        assert second == {"loss": 5.0}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 2]
    assert {k: rows[0][k] for k in ("loss", "acc")} == {"loss": 1.5, "acc": 0.25}
    assert rows[1]["loss"] == 5.0 and rows[2] == {"step": 2, "time": rows[2]["time"], "lr": 0.1}
    assert all(isinstance(r["time"], float) for r in rows)


def _many_metrics() -> dict[str, float]:
    rank = phalanx.world().rank
    metrics = {f"m{i:03d}": float(i + rank) for i in range(PACKET * 2)}
    return MetricsLogger().log(0, **metrics)


def test_more_metrics_than_one_packet() -> None:
    for averaged in run_distributed(_many_metrics, world_size=2):
        assert averaged == {f"m{i:03d}": i + 0.5 for i in range(PACKET * 2)}


def _mismatched_keys() -> str:
    rank = phalanx.world().rank
    extra = {"acc": 1.0} if rank == 1 else {}
    try:
        MetricsLogger().log(0, loss=1.0, **extra)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_keys_raise_on_every_rank() -> None:
    messages = run_distributed(_mismatched_keys, world_size=2, timeout=30)
    for msg in messages:
        assert "rank 0: ['loss']" in msg and "rank 1: ['acc', 'loss']" in msg


def _bad_value() -> str:
    value: object = "oops" if phalanx.world().rank == 0 else 1.0
    try:
        MetricsLogger().log(0, loss=value)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_non_number_raises_on_every_rank() -> None:
    messages = run_distributed(_bad_value, world_size=2, timeout=30)
    assert all("1 rank(s) passed metrics that are not numbers" in m for m in messages)
    assert "here: ['loss']" in messages[0] and "here" not in messages[1]


def test_single_process_without_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as logger:
        assert logger.log(3, loss=2.0, bad=math.inf) == {"bad": math.inf, "loss": 2.0}
        with pytest.raises(ValueError, match="'time' is reserved"):
            logger.log(4, time=1.0)
    row = json.loads(path.read_text())
    assert (row["step"], row["loss"], row["bad"]) == (3, 2.0, None)


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ImportError, match=r"pip install 'phalanx\[tensorboard\]'"):
        MetricsLogger(tensorboard_dir=str(tmp_path))
