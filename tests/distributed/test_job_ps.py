"""Parameter servers (phalanx.PS; presets "ps-sync", "ps-async", "ssp"), hogwild, Job.slow_down."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx import checkpoint
from phalanx.testing import DistributedTestError, run_distributed


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 10, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _train(strategy: str | phalanx.train.Strategy, kwargs: dict) -> dict:
    slow = kwargs.pop("slow_down", None)
    job = phalanx.Job(strategy, seed=1, **kwargs)
    if slow is not None:
        job.slow_down(*slow)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    model, _ = job.setup(model, opt, sched, loss_fn=nn.functional.cross_entropy)
    loader = job.loader(_data(), batch_size=8)
    batches, logged = 0, []
    for _ in job.epochs(2):
        for x, y in job.progress(loader):
            loss = job.forward_backward(x, y)
            job.step()
            batches += 1
        logged.append(job.log(loss=float(loss)))  # per worker: no collective among them
    state = {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}
    report = job.server_report
    job.close()
    return {
        "state": state,
        "batches": batches,
        "server": job.is_server,
        "report": report,
        "logged": logged,
    }


def test_ps_sync_job_equals_ddp_job() -> None:
    ddp = run_distributed(_train, "ddp", {}, world_size=2, timeout=60)
    ps = run_distributed(_train, "ps-sync", {}, world_size=3, timeout=60)  # the preset
    assert ps[0]["server"] and ps[0]["batches"] == 0
    assert ps[1]["batches"] == ps[2]["batches"] == ddp[0]["batches"] == 12
    report = ps[0]["report"]
    assert report.version == 12 and report.applied == 24
    assert ps[0]["logged"] == [] and len(ps[1]["logged"]) == 2
    for r in ps:  # the server holds the whole model (one server); workers load the final one
        for k, v in r["state"].items():
            # DDP's all-reduce and the server's average sum in different orders: rounding only.
            torch.testing.assert_close(v, ddp[0]["state"][k], rtol=1e-5, atol=1e-6)


def test_ssp_job_with_straggler_and_async_budget() -> None:
    ssp = run_distributed(
        _train,
        phalanx.PS(mode="ssp", staleness=1),
        {"slow_down": (1, 3.0)},
        world_size=3,
        timeout=60,
    )
    report = ssp[0]["report"]
    assert report.applied == 24 and max(report.staleness) <= 1
    budget = run_distributed(
        _train, phalanx.PS(mode="async", max_updates=10), {}, world_size=3, timeout=60
    )
    assert budget[0]["report"].applied == 10
    assert budget[1]["batches"] + budget[2]["batches"] == 10


def _hogwild() -> dict:
    job = phalanx.Job(phalanx.Hogwild(), seed=0)
    torch.manual_seed(job.world.rank)  # different inits: the job must start all from rank 0's
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = job.setup(model, opt, loss_fn=nn.functional.cross_entropy)
    first = model[0].weight.detach().clone()  # type: ignore[index]
    dist.barrier()
    with torch.no_grad():  # each rank adds rank+1 to one shared element, 5 times, in turn
        for _ in range(5):  # (at once, two read-modify-writes could lose one: Hogwild's races)
            for turn in range(job.world.world_size):
                if turn == job.world.rank:
                    model[2].bias[0] += job.world.rank + 1  # type: ignore[index]
                dist.barrier()
    shared_sum = float(model[2].bias[0].detach())  # type: ignore[index]
    dist.barrier()  # every rank has read it before any trains (and writes it) below
    loader = job.loader(_data(), batch_size=8)
    for _ in job.epochs(2):
        for x, y in job.progress(loader):
            job.forward_backward(x, y)
            job.step()
    dist.barrier()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    job.close()
    return {"first": first, "sum": shared_sum, "state": state}


def test_hogwild_job_shares_one_model() -> None:
    r = run_distributed(_hogwild, world_size=2, timeout=60)
    assert torch.equal(r[0]["first"], r[1]["first"])
    assert r[0]["sum"] == r[1]["sum"]
    torch.manual_seed(0)
    start = float(nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))[2].bias[0].detach())
    assert r[0]["sum"] == pytest.approx(start + 5 * (1 + 2), abs=1e-5)
    for k, v in r[0]["state"].items():  # one storage: both ranks see every update
        assert torch.equal(v, r[1]["state"][k]), k


def _hogwild_save(directory: str) -> list[torch.Tensor]:
    job = phalanx.Job(phalanx.Hogwild(), seed=0, checkpoint_dir=directory)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = job.setup(model, opt, loss_fn=nn.functional.cross_entropy)
    x, y = _data()[job.world.rank * 8 : job.world.rank * 8 + 8]
    job.forward_backward(x, y)  # each rank its own batch: its own AdamW moments
    job.step()
    dist.barrier()
    job.save(async_=False)
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    job.close()
    return moments


def test_a_hogwild_checkpoint_holds_rank_0s_optimizer_state(tmp_path: Path) -> None:
    """Each Hogwild rank steps its own optimizer: the ranks must not share the writing of
    the "replicated" state (``Strategy.replicas_equal``), or the file would mix them."""
    ours, theirs = run_distributed(_hogwild_save, str(tmp_path), world_size=2, timeout=60)
    assert not all(torch.equal(a, b) for a, b in zip(ours, theirs))
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.load(tmp_path, model=model, optimizer=opt)
    assert all(torch.equal(s["exp_avg"], a) for s, a in zip(opt.state.values(), ours))


def _bad(strategy: str | phalanx.train.Strategy, kwargs: dict) -> None:
    slow = kwargs.pop("slow_down", None)
    job = phalanx.Job(strategy, **kwargs)
    if slow is not None:
        job.slow_down(*slow)


@pytest.mark.parametrize(
    ("strategy", "kwargs", "match"),
    [
        ("ssp", {}, r"PS\(mode='ssp'\) needs a staleness bound"),
        (phalanx.PS(servers=2), {}, r"servers=2\) needs more ranks than servers.*world_size=2"),
        ("ps-sync", {"checkpoint_dir": "/tmp/x"}, r"checkpoint_dir='/tmp/x'"),
        ("ddp", {"slow_down": (5, 2.0)}, r"who=5 must be 'random' or a participant index"),
    ],
)
def test_bad_ps_options(strategy: str, kwargs: dict, match: str) -> None:
    with pytest.raises(DistributedTestError, match=match):
        run_distributed(_bad, strategy, kwargs, world_size=2, timeout=30)


def _late_workers() -> dict:
    import time

    job = phalanx.Job("ps-async", seed=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    if not job.is_server:  # the workers reach setup well after the server (slow imports, data)
        time.sleep(7.0)  # longer than the servers' 5 s of allowed silence
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = job.setup(model, opt, loss_fn=nn.functional.cross_entropy)
    batches = 0
    for _ in job.epochs(1):
        for x, y in job.progress(job.loader(_data(), batch_size=8)):
            job.forward_backward(x, y)
            job.step()
            batches += 1
    report = job.server_report
    job.close()
    return {"batches": batches, "lost": None if report is None else dict(report.lost)}


def test_workers_that_reach_setup_late_are_not_lost() -> None:
    # The servers' silence clock must not start before every worker exists: a worker whose
    # setup lags (a loaded machine, a slow import) was declared lost before it said anything.
    got = run_distributed(_late_workers, world_size=3, timeout=90)
    assert got[0]["lost"] == {}
    assert got[1]["batches"] == got[2]["batches"] == 6
