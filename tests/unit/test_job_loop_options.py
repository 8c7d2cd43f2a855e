"""The optimizer side of the job's loop, in one process: ``clip_grad_norm_`` under the fp16
scaler, ``setup(schedule=...)`` with ``ReduceLROnPlateau`` and per-epoch schedulers, and objects
checkpointed with ``job.track``; each resumed run is bit-identical to the uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx

LR, BATCH, N = 0.1, 4, 12  # 3 batches an epoch


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---- clip_grad_norm_ ---------------------------------------------------------------------------
def test_clip_in_fp16_sees_unscaled_gradients_and_step_unscales_once() -> None:
    x, y = _data().tensors
    ref = _model()
    with torch.autocast("cpu", dtype=torch.float16):  # fp16's forward, on CPU as on a GPU
        loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    with phalanx.Job("single", precision="fp16-mixed") as job:
        job.precision.configure_scaler(init_scale=2.0**12)
        scaler = job.precision.scaler
        assert scaler is not None
        model = _model()
        model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        job.backward(nn.functional.mse_loss(model(x), y))
        got = job.clip_grad_norm_(0.01)
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, want)  # not 4096 times larger
        assert job.step() and scaler.get_scale() == 2.0**12  # stepped, not skipped
        for p, q in zip(_params(model), _params(ref), strict=True):
            torch.testing.assert_close(p, q)  # unscaled by clip, not again by step


def test_a_micro_step_still_accumulating_is_not_clipped() -> None:
    x, y = _data().tensors
    with phalanx.Job("single", grad_accum=2) as job:
        model = _model()
        model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        job.backward(nn.functional.mse_loss(model(x[:4]), y[:4]))
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert torch.isnan(job.clip_grad_norm_(1e-3))
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        assert not job.step()
        job.backward(nn.functional.mse_loss(model(x[4:8]), y[4:8]))
        norm = job.clip_grad_norm_(1e-3)
        assert norm > 1e-3
        total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
        torch.testing.assert_close(total, torch.tensor(1e-3), rtol=1e-4, atol=0)


# ---- schedule= ----------------------------------------------------------------------------------
def _plateau_run(ckpt: Path, epochs: int) -> dict[str, Any]:
    """Train with ReduceLROnPlateau stepped by hand on a validation loss after each epoch."""
    with phalanx.Job("single", checkpoint_dir=ckpt) as job:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # threshold=0.5: only halving the loss counts as better, so the LR drops every epoch
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, threshold=0.5)
        model, opt = job.setup(model, opt, sched, schedule="manual")
        assert opt is not None
        loader = job.loader(_data(), batch_size=BATCH)
        x, y = _data().tensors
        for _ in job.epochs(epochs):
            for xb, yb in loader:
                job.backward(nn.functional.mse_loss(model(xb), yb))
                job.step()
            with torch.no_grad():
                sched.step(nn.functional.mse_loss(model(x), y).item())
            job.save()
        return {
            "lr": opt.param_groups[0]["lr"],
            "state": sched.state_dict(),
            "params": _params(model),
        }


def test_reduce_lr_on_plateau_through_a_job_is_checkpointed_and_resumed(tmp_path: Path) -> None:
    whole = _plateau_run(tmp_path / "whole", 4)
    assert whole["lr"] < LR / 4  # it did reduce, several times
    _plateau_run(tmp_path / "cut", 2)
    resumed = _plateau_run(tmp_path / "cut", 4)  # epochs 2 and 3, from the saved scheduler
    assert resumed["lr"] == whole["lr"] and resumed["state"] == whole["state"]
    assert all(torch.equal(p, q) for p, q in zip(resumed["params"], whole["params"], strict=True))


@pytest.mark.parametrize("schedule", ["step", "epoch"])
def test_an_automatic_schedule_refuses_reduce_lr_on_plateau(schedule: str) -> None:
    with phalanx.Job("single") as job:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        with pytest.raises(
            ValueError, match=rf"schedule='{schedule}'.*ReduceLROnPlateau.*'manual'"
        ):
            job.setup(model, opt, sched, schedule=schedule)


def _epoch_run(ckpt: Path, epochs: int, stop_at: int | None = None) -> dict[str, Any]:
    """StepLR(step_size=1) per epoch; a save after every step; stop after step ``stop_at``."""
    with phalanx.Job("single", checkpoint_dir=ckpt) as job:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt = job.setup(model, opt, sched, schedule="epoch")
        assert opt is not None
        loader = job.loader(_data(), batch_size=BATCH)
        lrs = []
        for _ in job.epochs(epochs):
            for xb, yb in loader:
                job.backward(nn.functional.mse_loss(model(xb), yb))
                job.step()
                lrs.append(opt.param_groups[0]["lr"])
                job.save()
                if job.step_count == stop_at:
                    return {}
        return {"lrs": lrs, "lr": opt.param_groups[0]["lr"], "params": _params(model)}


@pytest.mark.parametrize("stop_at", [2, 3], ids=["mid-epoch", "epoch-end"])
def test_an_epoch_schedule_steps_once_an_epoch_and_resumes(tmp_path: Path, stop_at: int) -> None:
    whole = _epoch_run(tmp_path / "whole", 2)
    assert whole["lrs"] == [LR] * 3 + [LR / 2] * 3 and whole["lr"] == LR / 4
    _epoch_run(tmp_path / "cut", 2, stop_at=stop_at)
    resumed = _epoch_run(tmp_path / "cut", 2)
    assert resumed["lrs"] == whole["lrs"][stop_at:] and resumed["lr"] == whole["lr"]
    assert all(torch.equal(p, q) for p, q in zip(resumed["params"], whole["params"], strict=True))


# ---- track ----------------------------------------------------------------------------------
class RunningLoss:
    """A user's object: a tensor and a counter, with torch's state-dict protocol."""

    def __init__(self) -> None:
        self.total = torch.zeros(1, dtype=torch.float64)
        self.count = 0

    def update(self, loss: torch.Tensor) -> None:
        self.total += loss.detach().double() / 3.0  # not exact in binary: bits must survive
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.count = state["total"].clone(), int(state["count"])


def _tracked_run(ckpt: Path, stop_at: int | None = None) -> RunningLoss:
    stats = RunningLoss()
    with phalanx.Job("single", checkpoint_dir=ckpt) as job:
        model = _model()
        model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        assert job.track("loss", stats) is stats
        loader = job.loader(_data(), batch_size=BATCH)
        for _ in job.epochs(2):
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                job.backward(loss)
                job.step()
                stats.update(loss)
                if job.step_count == stop_at:
                    job.save()
                    return stats
    return stats


def test_a_tracked_object_resumes_mid_epoch_bit_exact(tmp_path: Path) -> None:
    whole = _tracked_run(tmp_path / "whole")
    cut = _tracked_run(tmp_path / "cut", stop_at=4)  # epoch 1, after its first batch
    assert cut.count == 4
    resumed = _tracked_run(tmp_path / "cut")
    assert resumed.count == whole.count == 6
    assert torch.equal(resumed.total, whole.total)


def test_a_tracked_object_that_cannot_be_stored_is_named(tmp_path: Path) -> None:
    class Bad(RunningLoss):
        def state_dict(self) -> dict[str, Any]:
            return {"fn": print}

    with phalanx.Job("single", checkpoint_dir=tmp_path) as job:
        job.setup(_model())
        job.track("bad", Bad())
        with pytest.raises(TypeError, match=r"Job.track\('bad'\) state key 'fn'"):
            job.save()
    assert not list(tmp_path.glob("step-*"))  # refused before anything was written


def test_tracking_after_resume_is_refused(tmp_path: Path) -> None:
    with phalanx.Job("single", checkpoint_dir=tmp_path) as job:
        job.setup(_model())
        next(iter(job.epochs(1)))
        with pytest.raises(ValueError, match=r"Job.track\('late', ...\) after the job resumed"):
            job.track("late", RunningLoss())


# ---- parameter servers ----------------------------------------------------------------------
def test_parameter_servers_refuse_clipping_and_other_schedules() -> None:
    from phalanx.comm.group import World
    from phalanx.train.strategies.ps import PSRunner

    world = World(1, 2, 1, 2, 0, torch.device("cpu"), "gloo")  # a worker of 1 server + 1 worker
    runner = PSRunner(phalanx.PS(mode="async"), world)
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(\) with strategy PS\(mode='async'\)"):
        runner.clip_grad_norm_(1.0, 2.0)
    runner.check_schedule("step")  # the servers step it
    with pytest.raises(ValueError, match=r"schedule='epoch'\) with strategy PS\(mode='async'\)"):
        runner.check_schedule("epoch")


def test_checkpoint_objects_load_by_name_and_a_missing_name_is_named(tmp_path: Path) -> None:
    saved, loaded, other = RunningLoss(), RunningLoss(), RunningLoss()
    saved.update(torch.tensor(1.0))
    phalanx.checkpoint.save(tmp_path, 1, objects={"loss": saved})
    phalanx.checkpoint.load(tmp_path, objects={"loss": loaded})
    assert loaded.count == 1 and torch.equal(loaded.total, saved.total)
    with pytest.raises(phalanx.checkpoint.CheckpointError, match=r"holds no object 'acc'"):
        phalanx.checkpoint.load(tmp_path, objects={"acc": other})
    with pytest.warns(UserWarning, match=r"holds no object 'acc'.*strict=False"):
        phalanx.checkpoint.load(tmp_path, objects={"acc": other}, strict=False)
    assert other.count == 0


def test_fp16_runs_on_cpu_with_every_zero_stage_but_not_a_pipeline() -> None:
    from phalanx.comm.group import World
    from phalanx.train.strategies import JobOptions

    world = World(0, 2, 0, 2, 0, torch.device("cpu"), "gloo")
    for stage in (1, 2, 3):  # ZeRO-2's scaler unscales its reduced ranges
        phalanx.Zero(stage=stage).start(world, JobOptions(precision="fp16-mixed"))
    with pytest.raises(ValueError, match=r"precision='fp16-mixed' with a pipeline \(pp=2\)"):
        phalanx.Mesh(pp=2).start(world, JobOptions(precision="fp16-mixed"))


def test_configure_scaler_sets_torch_options_and_refuses_bad_ones() -> None:
    with phalanx.Job("single", precision="fp16-mixed") as job:
        job.precision.configure_scaler(init_scale=8.0, growth_interval=3)
        assert job.precision.scaler is not None
        assert job.precision.scaler.get_scale() == 8.0
        assert job.precision.scaler.get_growth_interval() == 3
        bad: list[tuple[dict[str, Any], str]] = [
            ({"init_scale": 0.0}, "init_scale"),
            ({"growth_factor": 0.5}, "growth_factor"),
            ({"backoff_factor": 1.5}, "backoff_factor"),
            ({"growth_interval": 0}, "growth_interval"),
        ]
        for options, name in bad:
            value = next(iter(options.values()))
            with pytest.raises(ValueError, match=rf"{name}.*{value}"):
                job.precision.configure_scaler(**options)
        model, _ = job.setup(_model(), None)
        x, y = _data().tensors
        job.backward(nn.functional.mse_loss(model(x), y))
        with pytest.raises(ValueError, match=r"before the first backward"):
            job.precision.configure_scaler(init_scale=8.0)
    with (
        phalanx.Job("single") as job,
        pytest.raises(ValueError, match=r"precision='fp32' has no gradient scaler"),
    ):
        job.precision.configure_scaler(init_scale=8.0)
