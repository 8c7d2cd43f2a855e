"""Job resume in one process: ``save(**values)`` comes back as ``job.resumed_extra``, a loader's
dropped tail ends the epoch, old checkpoints still resume, generator snapshots round-trip."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint import rng


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


def _data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1))


def _job(
    ckpt: Path, precision: str = "fp32"
) -> tuple[phalanx.Job, torch.utils.data.DataLoader[object]]:
    job = phalanx.Job(strategy="single", checkpoint_dir=ckpt, precision=precision)
    model, _ = job.setup(nn.Linear(4, 1))
    job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return job, job.loader(_data(), batch_size=4)


def test_values_given_to_save_come_back_on_resume(tmp_path: Path) -> None:
    values: dict[str, Any] = {
        "best": 0.25,
        "tags": ["a", "b"],
        "nested": {"k": 1, "none": None},
        "epoch": 7,
    }
    job, loader = _job(tmp_path)
    with job:
        assert job.resumed_extra == {}  # nothing resumed yet
        for _ in job.epochs(3):
            for x, y in loader:  # the loader itself, not job.progress()
                job.backward(nn.functional.mse_loss(job.model(x), y))  # type: ignore[misc]
                job.step()
                job.save(**values)  # "epoch" is the user's: the job keeps its own apart
                break
            break
        assert job.resumed_extra == {}
    job, loader = _job(tmp_path)
    with job:
        assert next(iter(job.epochs(3))) == 0  # mid-epoch: the same epoch, after one batch
        assert job.resumed_extra == values
        assert job.step_count == 1 and job.sampler is not None and job.sampler.position == 4
        assert sum(1 for _ in loader) == 2


def test_a_save_after_the_last_batch_before_a_dropped_tail_ends_the_epoch(tmp_path: Path) -> None:
    # 10 samples, batches of 4, drop_last: the loader drops the last 2, so 2 batches an epoch.
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
    for run in range(2):
        with phalanx.Job(strategy="single", checkpoint_dir=tmp_path) as job:
            model, _ = job.setup(nn.Linear(4, 1))
            job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = job.loader(data, batch_size=4, drop_last=True, even_batches=False)
            epochs = iter(job.epochs(3))
            if run == 1:  # resumed after epoch 0's last batch: epoch 1 begins
                assert next(epochs) == 1 and len(list(loader)) == 2
                break
            next(epochs)
            for x, y in loader:
                job.backward(nn.functional.mse_loss(model(x), y))
                job.step()
                if job.step_count == 2:
                    job.save()


def test_the_loss_scale_comes_back(tmp_path: Path) -> None:
    scales = []
    for run in range(2):
        job, loader = _job(tmp_path, "fp16-mixed")  # torch's CPU scaler and fp16 autocast
        with job:
            job.precision.configure_scaler(init_scale=16.0, growth_interval=1)
            assert job.precision.scaler is not None
            for _ in job.epochs(1 + run):
                for x, y in loader:
                    job.backward(nn.functional.mse_loss(job.model(x), y))  # type: ignore[misc]
                    job.step()
                job.save()
            scales.append(job.precision.scaler.get_scale())
    assert scales == [16.0 * 2**3, 16.0 * 2**6]  # doubled after each of 3 steps an epoch


def test_a_tensor_value_is_refused_naming_its_key(tmp_path: Path) -> None:
    job, _ = _job(tmp_path)
    with job, pytest.raises(TypeError, match=r"Job.save\(...\) key 'stats.mean' holds a tensor"):
        job.save(stats={"mean": torch.zeros(1)})
    assert not list(tmp_path.glob("step-*"))  # refused before anything was written


def test_checkpoints_written_before_values_were_kept_apart_still_resume(tmp_path: Path) -> None:
    # The job's fields used to sit beside the user's values in the manifest's extra.
    legacy = {"epoch": 1, "epoch_done": True, "tag": "x"}
    job, _ = _job(tmp_path)
    with job:
        phalanx.checkpoint.save(tmp_path, 5, model=job.model, optimizer=job.optimizer, extra=legacy)
        job.state.sampler = None  # that checkpoint holds no sampler state
        assert next(iter(job.epochs(4))) == 2
        assert job.resumed_extra == {"tag": "x"} and job.step_count == 5


def test_generator_snapshots_round_trip() -> None:
    state = rng.snapshot()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    rng.apply(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])
    doc = rng.capture(state)  # what a checkpoint stores, from the same snapshot
    assert rng.restore(doc, "test") == []
    assert random.random() == drawn[0]


def test_job_save_is_asynchronous_by_default_and_close_waits(tmp_path: Path) -> None:
    from phalanx.checkpoint import background

    job, loader = _job(tmp_path)
    with job:
        for _ in job.epochs(1):
            for x, y in loader:
                job.backward(nn.functional.mse_loss(job.model(x), y))  # type: ignore[misc]
                job.step()
                assert job.model is not None
                saved = {k: v.clone() for k, v in job.model.state_dict().items()}
                path = job.save(tag="async")
                assert background.in_flight() and path == tmp_path / "step-000001"
                with torch.no_grad():  # training goes on in place while it is written
                    for p in job.model.parameters():
                        p.add_(1.0)
                break
            break
    assert not background.in_flight()  # close() waited
    model = nn.Linear(4, 1)
    info = phalanx.checkpoint.load(tmp_path, model=model)
    assert info is not None and info.extra["values"] == {"tag": "async"}
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    job, _ = _job(tmp_path)
    with job:
        next(iter(job.epochs(1)))
        assert job.save(async_=False) == tmp_path / "step-000001"
        assert not background.in_flight()
        with pytest.raises(TypeError, match=r"Job\.save\(async_='no'\): async_ must be True"):
            job.save(async_="no")  # type: ignore[arg-type]
