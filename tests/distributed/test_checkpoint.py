"""Checkpoints on 2 gloo ranks: DDP resume, per-rank RNG, slow rank-0 writes, world-size change."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import phalanx
from phalanx import checkpoint
from phalanx.testing import run_distributed


class Sampler:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _job() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 4))
    ddp = phalanx.DistributedDataParallel(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s // 2))
    return ddp, opt, sched


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        x = torch.randn(4, 8)  # per-rank data from the per-rank generator
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out


def _draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def _resume(directory: str) -> dict[str, Any]:
    rank = phalanx.world().rank
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)
    ddp, opt, sched = _job()
    _train(ddp, opt, sched, 3)
    sampler = Sampler()
    sampler.position = 100 + rank
    checkpoint.save(
        directory, 3, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler, extra={"epoch": 1}
    )
    uninterrupted = _draws() + _train(ddp, opt, sched, 3)
    params = [p.detach().clone() for p in ddp.parameters()]

    ddp2, opt2, sched2 = _job()
    sampler2 = Sampler()
    info = checkpoint.load(
        directory, model=ddp2, optimizer=opt2, scheduler=sched2, sampler=sampler2
    )
    assert info is not None
    resumed = _draws() + _train(ddp2, opt2, sched2, 3)
    same = all(torch.equal(a, b) for a, b in zip(params, ddp2.parameters()))
    return {
        "first": uninterrupted,
        "second": resumed,
        "same_params": same,
        "info": info,
        "sampler": sampler2.position,
    }


def test_ddp_resume_is_bit_identical_with_per_rank_rng(tmp_path: Path) -> None:
    results = run_distributed(_resume, str(tmp_path), world_size=2)
    for rank, r in enumerate(results):
        assert r["second"] == r["first"], rank
        assert r["same_params"] and r["sampler"] == 100 + rank
        assert r["info"].step == 3 and r["info"].world_size == 2 and r["info"].extra == {"epoch": 1}
    assert results[0]["first"][:3] != results[1]["first"][:3]  # the ranks' generators differ
    files = sorted(p.name for p in (tmp_path / "step-000003").iterdir())
    assert [f for f in files if f.startswith("rank-")] == [
        "rank-00000.json",
        "rank-00000.safetensors",
        "rank-00001.json",
        "rank-00001.safetensors",
    ]


def _slow_rank0(directory: str) -> tuple[float, float]:
    from phalanx.checkpoint import atomic

    rank = phalanx.world().rank
    if rank == 0:
        write = atomic.write_file

        def slow(path: Path, *args: Any, **kwargs: Any) -> Any:
            if path.name == "model.json":  # rank 0 writes the sections' JSON files
                time.sleep(4)  # twice the collective timeout
            return write(path, *args, **kwargs)

        atomic.write_file = slow
    model = nn.Linear(4, 4)
    start = time.monotonic()
    checkpoint.save(directory, 1, model=model)
    elapsed = time.monotonic() - start
    t = torch.ones(1)
    phalanx.all_reduce(t)  # the group still works after the long wait
    checkpoint.load(directory, model=model)
    return elapsed, t.item()


def test_slow_rank0_write_does_not_time_out_the_others(tmp_path: Path) -> None:
    results = run_distributed(_slow_rank0, str(tmp_path), world_size=2, collective_timeout=2)
    assert [total for _, total in results] == [2.0, 2.0]
    assert min(elapsed for elapsed, _ in results) >= 4.0  # both waited for the commit


def _save_only(directory: str) -> None:
    rank = phalanx.world().rank
    torch.manual_seed(rank)
    model = nn.Linear(6, 3)
    phalanx.broadcast(model.weight.data, 0)
    phalanx.broadcast(model.bias.data, 0)
    checkpoint.save(directory, 9, model=phalanx.DistributedDataParallel(model))


def test_save_on_two_ranks_load_in_one_process(tmp_path: Path) -> None:
    run_distributed(_save_only, str(tmp_path), world_size=2)
    torch.manual_seed(0)
    expected = nn.Linear(6, 3)  # rank 0's parameters, which rank 0 broadcast
    model = nn.Linear(6, 3)
    info = checkpoint.load(tmp_path, model=model)
    assert info is not None and info.world_size == 2
    assert torch.equal(model.weight, expected.weight)
    assert any("RNG states of ranks 1..1 are ignored" in n for n in info.notes)
    torch.manual_seed(0)
    nn.Linear(6, 3)
    rank0_next_draw = torch.rand(3)  # what rank 0 drew next after its save
    checkpoint.load(tmp_path, model=model)
    assert torch.equal(torch.rand(3), rank0_next_draw)


class _Broken:
    def state_dict(self) -> dict[str, Any]:
        if phalanx.world().rank == 1:
            raise OSError("disk full on rank 1")
        return {}


def _failing_peer(directory: str) -> str:
    try:
        checkpoint.save(directory, 1, model=nn.Linear(2, 2), sampler=_Broken())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_failing_rank_fails_the_save_everywhere(tmp_path: Path) -> None:
    errors = run_distributed(_failing_peer, str(tmp_path), world_size=2, collective_timeout=5)
    assert (
        errors[0].startswith("CheckpointError: rank 1 could not write") and "disk full" in errors[0]
    )
    assert errors[1] == "OSError: disk full on rank 1"
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the temporary directory


def _async_saves(directory: str) -> dict[str, Any]:
    from phalanx.checkpoint import atomic

    rank = phalanx.world().rank
    if rank == 0:  # rank 0 writes slowly: the ranks finish each write at different times
        write = atomic.write_file

        def slow(path: Path, *args: Any, **kwargs: Any) -> Any:
            if path.name == "model.safetensors":
                time.sleep(1.5)
            return write(path, *args, **kwargs)

        atomic.write_file = slow
    torch.manual_seed(0)
    ddp, opt, sched = _job()
    saved = []
    for step in (1, 2, 3):
        _train(ddp, opt, sched, 2)  # all-reduces on the training thread during the write
        checkpoint.save(directory, step, model=ddp, optimizer=opt, scheduler=sched, async_=True)
        saved.append([p.detach().clone() for p in ddp.parameters()])
        t = torch.ones(1)
        phalanx.all_reduce(t)
    last = checkpoint.wait()
    ddp2, opt2, sched2 = _job()
    info = checkpoint.load(directory, model=ddp2, optimizer=opt2, scheduler=sched2)
    assert info is not None
    return {
        "last": last,
        "step": info.step,
        "same": all(torch.equal(a, b) for a, b in zip(saved[-1], ddp2.parameters())),
    }


def test_async_saves_interleave_with_collectives(tmp_path: Path) -> None:
    results = run_distributed(_async_saves, str(tmp_path), world_size=2, collective_timeout=5)
    for r in results:
        assert r == {"last": tmp_path / "step-000003", "step": 3, "same": True}
