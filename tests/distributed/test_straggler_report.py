"""A rank made 1.5x slower is named by the job within 20 steps; without one, nobody is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed


class _Work(nn.Module):
    """A layer whose forward takes ~4 ms of wall time (sleep: no CPU contention on 2 cores)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return self.lin(x)


def _train(straggler: tuple[int, float] | None, metrics: str) -> dict:
    job = phalanx.Job(strategy="ddp", straggler=straggler, straggler_check_every=5,
                      metrics_file=metrics)  # fmt: skip
    model, opt = job.setup(_Work(), None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    found_at = None
    for step in range(20):
        loss = model(torch.randn(4, 8)).sum()
        job.backward(loss)
        job.step(opt)
        if found_at is None and job.straggler_finding is not None:
            found_at = step + 1
    finding = job.straggler_finding
    job.close()
    return {"at": found_at, "rank": None if finding is None else finding.rank,
            "factor": None if finding is None else finding.factor}  # fmt: skip


def test_slow_rank_is_named_within_20_steps(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    r = run_distributed(_train, (1, 1.5), str(metrics), world_size=2, timeout=60)
    assert r[0]["rank"] == 1 and r[1]["rank"] == 1  # every rank knows; rank 0 reports
    assert r[0]["at"] is not None and r[0]["at"] <= 20
    assert 1.2 <= r[0]["factor"] <= 2.0, r[0]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(row.get("straggler_rank") == 1 for row in rows), rows


def test_no_straggler_no_report(tmp_path: Path) -> None:
    r = run_distributed(_train, None, str(tmp_path / "m.jsonl"), world_size=2, timeout=60)
    assert r[0]["rank"] is None and r[1]["rank"] is None
