"""phalanx.Job in one process (a world of one): precision, strategies, argument errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import phalanx
from phalanx.comm.group import World
from phalanx.train import Single, Strategy, register_strategy, strategy_names


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_bf16_autocasts_the_forward_and_keeps_fp32_master_weights(tmp_path: Path) -> None:
    with phalanx.Job(strategy="single", precision="bf16-mixed", checkpoint_dir=tmp_path) as job:
        model, _ = job.setup(nn.Linear(4, 3), None)
        job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(torch.randn(2, 4))
        assert out.dtype == torch.bfloat16
        job.backward(out.float().pow(2).mean())
        assert job.step() is True
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert job.world.world_size == 1
    assert not phalanx.is_initialized()  # the job created the group, so it destroyed it


@pytest.mark.parametrize("name", ["fp16", "fp16-mixed"])
def test_fp16_on_cpu_autocasts_and_scales_the_loss(name: str) -> None:
    # torch 2.13 autocasts Linear to fp16 on CPU and has a CPU GradScaler: no GPU needed.
    with phalanx.Job(strategy="single", precision=name) as job:
        job.precision.configure_scaler(init_scale=2.0**8)
        torch.manual_seed(0)
        model, _ = job.setup(nn.Linear(4, 3), None)
        job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        out = model(torch.randn(2, 4))
        assert out.dtype == torch.float16
        job.backward(out.float().pow(2).mean())
        assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32
        scaled = model.weight.grad.clone()  # 2**8 times the true gradient until step()
        assert job.step()
        torch.testing.assert_close(model.weight.detach(), before - 0.1 * scaled / 2.0**8)
        assert job.precision.scaler is not None and job.precision.scaler.get_scale() == 2.0**8
    assert not phalanx.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "zero9"}, "Job.strategy='zero9'.: strategy must be one of"),
        ({"grad_accum": 0}, "grad_accum must be an int >= 1, got int 0"),
        ({"precision": "fp8"}, "Job.precision='fp8'.: precision must be one of"),
    ],
)
def test_bad_job_arguments_name_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        phalanx.Job(**kwargs)  # type: ignore[arg-type]
    assert not phalanx.is_initialized()


def test_strategy_registry() -> None:
    assert {"ddp", "torch-ddp", "dp", "single"} <= set(strategy_names())
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("ddp", Single)


@dataclass(frozen=True)
class _Doubled(Strategy):
    """A user's own strategy: one class, registered in one call."""

    name: ClassVar[str] = "doubled"
    scale: float = 2.0

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        return nn.Sequential(model, _Scale(self.scale))


class _Scale(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_users_strategy_class_runs_by_name_and_as_an_object() -> None:
    register_strategy("doubled", _Doubled, replace=True)
    assert "doubled" in strategy_names()
    x = torch.ones(1, 2)
    for strategy in ("doubled", _Doubled(scale=3.0)):
        with phalanx.Job(strategy) as job:
            inner = nn.Linear(2, 1)
            model, _ = job.setup(inner)
            assert isinstance(job.strategy, _Doubled)
            assert torch.equal(model(x), job.strategy.scale * inner(x))


def test_presets_are_fresh_strategy_objects() -> None:
    with phalanx.Job("single") as job:
        assert job.strategy == Single() and job.strategy.name == "single"
    assert phalanx.Zero(stage=2) == phalanx.Zero(stage=2)  # options compare by value
    with pytest.raises(AttributeError):  # frozen: a job cannot change a shared object
        phalanx.Zero().stage = 3  # type: ignore[misc]


def test_save_needs_a_directory() -> None:
    with phalanx.Job(strategy="single") as job:
        job.setup(nn.Linear(2, 2))
        with pytest.raises(ValueError, match="checkpoint_dir"):
            job.save()


def test_profile_dir_writes_a_trace_through_the_job(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with phalanx.Job(strategy="single", profile_dir=tmp_path) as job:
        model, _ = job.setup(nn.Linear(4, 1))
        job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in job.progress(job.loader(data, batch_size=4)):
            job.backward(nn.functional.mse_loss(model(x), y))
            job.step()
    assert (tmp_path / "rank0.pt.trace.json").stat().st_size > 0


def test_a_save_before_any_batch_resumes_the_same_epoch(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with phalanx.Job(strategy="single", checkpoint_dir=tmp_path) as job:
        job.setup(nn.Linear(4, 1))
        job.loader(data, batch_size=4)
        for _ in job.epochs(3):
            job.save()  # at the start of epoch 0: nothing of it has been trained yet
            break
    with phalanx.Job(strategy="single", checkpoint_dir=tmp_path) as job:
        job.setup(nn.Linear(4, 1))
        job.loader(data, batch_size=4)
        assert next(iter(job.epochs(3))) == 0


@dataclass(frozen=True)
class _Unmeasured(Strategy):
    name: ClassVar[str] = "unmeasured"
    comm_measured: ClassVar[bool] = False


def test_summary_says_not_measured_instead_of_a_silent_zero() -> None:
    for strategy, measured in ((Single(), True), (_Unmeasured(), False)):
        with phalanx.Job(strategy) as job:
            model, _ = job.setup(nn.Linear(2, 1), None)
            job.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            job.backward(model(torch.ones(4, 2)).sum())
            job.step()
            summary = job.summary()
        for key in ("comm_share", "comm_wait_seconds"):
            assert (summary[key] == summary[key]) is measured, (strategy, key)  # NaN != NaN
        if measured:
            assert summary["comm_wait_seconds"] == 0.0  # one process waits for nobody
