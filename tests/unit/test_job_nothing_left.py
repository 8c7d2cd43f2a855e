"""A finished job started again (the README's Quick start run twice) resumes at its last
epoch, trains nothing and says why, with what to change (issue 36, troubleshooting)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx

SAID = "nothing left to train: the checkpoint is at epoch 2 and epochs(2) ends there"


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


def _train(ckpt: Path, epochs: int) -> int:
    """Run the job for ``epochs``; return its step count at the end (resumed ones included)."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    with phalanx.Job("single", checkpoint_dir=ckpt) as job:
        model, _ = job.setup(nn.Linear(4, 1), None)
        job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in job.epochs(epochs):
            for x, y in job.progress(job.loader(data, batch_size=4)):
                job.backward(nn.functional.mse_loss(model(x), y))
                job.step()
            job.save()
        return job.step_count


def test_a_finished_job_run_again_says_there_is_nothing_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phalanx")
    assert _train(tmp_path, 2) == 4
    assert SAID not in caplog.text  # a fresh run has something to train
    assert _train(tmp_path, 2) == 4  # no step more
    assert f"{SAID}; raise the count to train on, or pass another checkpoint_dir" in caplog.text
    caplog.clear()
    assert _train(tmp_path, 3) == 6  # a larger count trains on from the checkpoint
    assert "nothing left" not in caplog.text
