"""ZeRO-1 and ZeRO-2: parity with one process and with DDP, 1/N state and gradients, volume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.data_parallel import DistributedDataParallel
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.testing import run_distributed

STEPS, PER_RANK = 5, 6
TINY_BUCKETS = 1e-4  # ~100 bytes: many buckets, parameters split across ranks' ranges


def _model() -> nn.Module:
    torch.manual_seed(0)  # 10*7+7 + 7*3+3 = 101 parameters: not divisible by 2 or 3
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 10, generator=g), torch.randn(PER_RANK, 3, generator=g)


OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups, as users write them: no weight decay (and a smaller lr) for biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.05}]


def _train(name: str, stage: int) -> dict[str, Any]:
    cls, kw = OPTS[name]
    rank = phalanx.world().rank
    model, twin = _model(), _model()
    opt = ZeroRedundancyOptimizer(
        _groups(model), cls, stage=stage, bucket_cap_mb=TINY_BUCKETS, **kw
    )
    ddp = DistributedDataParallel(twin)
    ddp_opt = cls(_groups(twin), **kw)
    leftover_grads, grad_bytes = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        leftover_grads.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        grad_bytes.append(opt.grad_bytes())
        ddp_opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp_opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ddp": [p.detach().clone() for p in twin.parameters()],
        "state_bytes": opt.state_bytes(),
        "grad_bytes": grad_bytes,
        "leftover_grads": leftover_grads,
        "buckets": len(opt.layout.buckets),
    }


def _reference(name: str, world: int) -> list[torch.Tensor]:
    cls, kw = OPTS[name]
    model = _model()
    opt = cls(_groups(model), **kw)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*[_batch(step, r) for r in range(world)])
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_zero_matches_one_process_and_ddp(name: str, stage: int, world_size: int) -> None:
    results = run_distributed(_train, name, stage, world_size=world_size)
    ref = _reference(name, world_size)
    total = sum(p.numel() for p in ref)
    for res in results:
        for got, want, ddp, rank0 in zip(res["params"], ref, res["ddp"], results[0]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, ddp, rtol=1e-5, atol=1e-6)
            assert torch.equal(got, rank0)  # replicas bit-identical
        per_element = 8 if name == "adamw" else 4  # exp_avg + exp_avg_sq, or momentum
        ideal = per_element * total / world_size
        assert res["state_bytes"] <= 1.02 * ideal + per_element * res["buckets"]
        # Gradient shards: 4Ψ/N (+ at most one padding element per bucket, + one gradient
        # flag per parameter: 4 here).
        assert max(res["grad_bytes"]) <= 4 * (total / world_size + res["buckets"] + 4)
        if stage == 2:  # full gradients are freed during backward, bucket by bucket
            assert res["leftover_grads"] == [0] * STEPS
        else:
            assert res["leftover_grads"] == [4] * STEPS


def _accumulate_and_clip(stage: int, max_norm: float) -> dict[str, Any]:
    rank = phalanx.world().rank
    model = _model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, stage=stage, bucket_cap_mb=TINY_BUCKETS, lr=0.1
    )
    norms = []
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(step, rank)
        with opt.no_sync():
            (nn.functional.mse_loss(model(x[:3]), y[:3]) / 2).backward()
        (nn.functional.mse_loss(model(x[3:]), y[3:]) / 2).backward()
        norms.append(float(opt.clip_grad_norm_(max_norm)))
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms}


@pytest.mark.parametrize("stage", [1, 2])
def test_no_sync_accumulation_and_global_norm_clipping(stage: int) -> None:
    max_norm = 0.05  # small enough to clip every step
    results = run_distributed(_accumulate_and_clip, stage, max_norm, world_size=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(3):
        opt.zero_grad()
        parts = [_batch(step, r) for r in range(2)]
        mse = nn.functional.mse_loss
        loss = sum(mse(model(x[:3]), y[:3]) + mse(model(x[3:]), y[3:]) for x, y in parts)
        (loss / 4).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    for res in results:
        assert res["norms"] == pytest.approx(norms, rel=1e-5)
        assert all(n > max_norm for n in norms)
        for got, want in zip(res["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _volume(stage: int) -> dict[str, int]:
    model, twin = _model(), _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    ddp = DistributedDataParallel(twin)
    x, y = _batch(0, phalanx.world().rank)
    nn.functional.mse_loss(ddp(x), y).backward()  # DDP's first step (warm-up buckets)
    phalanx.reset_comm_stats()
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp_stats = phalanx.comm_stats()
    phalanx.reset_comm_stats()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    stats = phalanx.comm_stats()
    world = phalanx.world().world_size
    return {
        "ddp": 2 * ddp_stats["all_reduce"][1],  # an all-reduce moves 2Ψ (reduce-scatter + gather)
        "zero": stats["reduce_scatter_tensor"][1] + world * stats["all_gather_into_tensor"][1],
        "psi_bytes": 4 * sum(p.numel() for p in model.parameters()),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_collective_volume_equals_ddp(stage: int) -> None:
    for res in run_distributed(_volume, stage, world_size=3):
        assert res["ddp"] == 2 * res["psi_bytes"]
        # 2Ψ like DDP; padding adds at most one element per rank (one bucket here), and the
        # reduce-scatter one gradient flag per parameter (4) per rank.
        assert res["ddp"] <= res["zero"] <= res["ddp"] + 2 * 4 * 3 + 4 * 4 * 3


def _full_state(opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """The whole state on every rank: consolidated to each rank in turn (as torch's API does)."""
    world = phalanx.world()
    for to in range(world.world_size):
        opt.consolidate_state_dict(to=to)
        if to == world.rank:
            full = opt.state_dict()
    return full


def _state_dicts() -> dict[str, Any]:
    model, twin = _model(), _model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, stage=2, bucket_cap_mb=TINY_BUCKETS, lr=1e-2
    )
    x, y = _batch(0, phalanx.world().rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    full = _full_state(opt)
    # A plain AdamW over an identical model takes the full state and steps identically.
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    plain.load_state_dict(full)
    # And a fresh ZeRO optimizer takes it back, each rank keeping its shard.
    again = ZeroRedundancyOptimizer(twin.parameters(), torch.optim.AdamW, lr=1e-2)
    again.load_state_dict(full)
    return {"full": full, "again": _full_state(again), "rank": phalanx.world().rank}


def test_state_dict_is_torch_format_and_round_trips() -> None:
    results = run_distributed(_state_dicts, world_size=3)
    full = results[0]["full"]
    assert sorted(full["state"]) == [0, 1, 2, 3]
    assert full["state"][0]["exp_avg"].shape == (7, 10)
    assert float(full["state"][0]["step"]) == 1.0
    for res in results:
        for i, st in full["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(res["full"]["state"][i][k], v)
                torch.testing.assert_close(res["again"]["state"][i][k], v)


def _bad(kind: str) -> str:
    model = _model()
    try:
        if kind == "stage":
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=3, lr=0.1)
        elif kind == "class":
            ZeroRedundancyOptimizer(model.parameters(), "adam", lr=0.1)  # type: ignore[arg-type]
        elif kind == "lbfgs":
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)
        elif kind == "clip":
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).clip_grad_norm_(0)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("stage", "stage must be None (gradients averaged by DDP), 1 or 2 (stage 3 is"),
        ("class", "'adam'"),
        ("lbfgs", "optimizer_class=LBFGS cannot step a ZeRO shard"),
        ("clip", "max_norm must be positive"),
    ],
)
def test_bad_arguments_are_named(kind: str, words: str) -> None:
    assert words in _bad(kind)
