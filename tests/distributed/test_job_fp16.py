"""``precision="fp16-mixed"`` on 2 gloo ranks, and a dp x tp mesh on 4 (CPU autocast, torch's CPU
gradient scaler).

Each strategy trains like one process running the ranks' half-batches as micro-batches under
the same scaler settings, and an inf injected into ONE rank's gradient makes every rank skip
that step and halve its scale; the replicas stay identical.

Why the injected inf reaches one rank only: it is put into one element of the first layer's
weight gradient on rank 1. Under DDP the all-reduce spreads it (both ranks see it anyway); under
ZeRO-1/2 the reduce-scatter lands it in the one rank that owns that element's range, under
ZeRO-3 in the one rank holding that flat shard, under torch FSDP in one DTensor shard, and under
a tensor-parallel mesh it stays in rank 1's own shard. Without agreement that rank would skip
and the other step (ZeRO-1 even deadlocks: the skipping rank leaves the step's collectives).

Tolerance: the reference's micro-batches round their fp16 backward exactly as the ranks do, and
the halving, the scale and the unscaling are powers of two, so DDP and ZeRO-1/2/3 match it
bitwise (measured; asserted with ``torch.equal``). The tensor-parallel GPT splits its matmuls
over two ranks, which rounds fp16 partial sums differently from one process: its losses are
compared to the one-process fp16 run at the tolerance measured there (see ``GPT_RTOL``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed

STEPS, PER_RANK, SCALE, GROWTH, POISONED = 4, 2, 2.0**10, 2, 1
"""Steps, samples per rank and step, initial scale, growth interval, the step whose gradient
holds an inf on rank 1 (scales: 2**10, 2**9 after the skip, 2**9, 2**10 after two good steps)."""


class _Poison(torch.autograd.Function):
    """Identity forward; its backward puts an inf into the gradient's first element."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


class _PoisonedLinear(nn.Linear):
    """A Linear whose weight gradient gets an inf while :attr:`poison` is set."""

    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _Poison.apply(self.weight) if self.poison else self.weight
        return nn.functional.linear(x, w, self.bias)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = _PoisonedLinear(6, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    n = STEPS * 2 * PER_RANK
    return torch.utils.data.TensorDataset(
        torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)
    )


def _reference() -> dict[str, Any]:
    """One process: each rank's half-batch a micro-batch, rank 1's poisoned at POISONED."""
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=GROWTH)
    data = _data()
    x, y = data.tensors
    ranks = [list(phalanx.DistributedSampler(data, 2, r, shuffle=False)) for r in range(2)]
    scales, params = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for rank, idx in enumerate(ranks):
            half = idx[step * PER_RANK : (step + 1) * PER_RANK]
            model.first.poison = step == POISONED and rank == 1
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[half])
            scaler.scale(nn.functional.mse_loss(out, y[half]) / 2).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return {"scales": scales, "params": params}


def _whole_params(strategy: str, model: nn.Module) -> list[torch.Tensor]:
    if strategy == "zero3":
        state = model.full_state_dict(rank0_only=False)  # type: ignore[operator]
        keys = ("first.weight", "first.bias", "second.weight", "second.bias")
        return [state[k].clone() for k in keys]
    from torch.distributed.tensor import DTensor

    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def _mlp_job(strategy: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    inner = _MLP()
    job = phalanx.Job(strategy, precision="fp16-mixed")
    job.precision.configure_scaler(init_scale=SCALE, growth_interval=GROWTH)
    model, _ = job.setup(inner, torch.optim.SGD(inner.parameters(), lr=0.5))
    scaler = job.precision.scaler
    assert scaler is not None
    scales, params = [], []
    loader = job.loader(_data(), batch_size=PER_RANK, shuffle=False)
    for step, (x, y) in enumerate(job.progress(loader)):
        inner.first.poison = step == POISONED and job.world.rank == 1
        job.backward(nn.functional.mse_loss(model(x), y))
        assert job.step()
        scales.append(scaler.get_scale())
        params.append(_whole_params(strategy, model))
    job.close()
    return {"scales": scales, "params": params}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "torch-fsdp"])
def test_fp16_matches_one_process_and_every_rank_skips_an_overflow(strategy: str) -> None:
    ranks = run_distributed(_mlp_job, strategy, world_size=2, timeout=90)
    ref = _reference()
    assert ref["scales"] == [SCALE, SCALE / 2, SCALE / 2, SCALE]  # the skip, then growth
    for rank, got in enumerate(ranks):
        assert got["scales"] == ref["scales"], f"rank {rank}"
        before, skipped = got["params"][POISONED - 1], got["params"][POISONED]
        assert all(torch.equal(a, b) for a, b in zip(before, skipped, strict=True))
        for step in range(STEPS):
            for p, q, want in zip(
                got["params"][step], ranks[0]["params"][step], ref["params"][step], strict=True
            ):
                assert torch.equal(p, q), f"rank {rank} step {step}: the replicas differ"
                assert torch.equal(p, want), f"rank {rank} step {step}: not the reference's"


def _gpt_data(replicas: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 65, (STEPS * PER_RANK * replicas, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 65, x.shape, generator=g))


def _poison_hook(on: dict[str, bool]) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not on["now"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return hook


def _gpt_job(dp: int) -> dict[str, Any]:
    """Mesh(dp=dp, tp=2): rank 1 poisons one of its own shard's gradients at POISONED."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    ref = copy.deepcopy(model)
    job = phalanx.Job(phalanx.Mesh(dp=dp, tp=2), precision="fp16-mixed")
    job.precision.configure_scaler(init_scale=SCALE, growth_interval=GROWTH)
    job.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    assert job.model is not None and job.precision.scaler is not None
    on = {"now": False}
    next(job.model.parameters()).register_hook(_poison_hook(on))
    losses, scales, skipped = [], [], []
    for step, (x, y) in enumerate(job.progress(job.loader(_gpt_data(dp), PER_RANK, shuffle=False))):
        on["now"] = step == POISONED and job.world.rank == 1
        before = [p.detach().clone() for p in job.model.parameters()]
        losses.append(float(job.forward_backward(x, y)))
        job.step()
        scales.append(job.precision.scaler.get_scale())
        after = list(job.model.parameters())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    params = [p.detach().clone() for p in job.model.parameters()]
    job.close()
    reference = _gpt_reference(ref) if dp == 1 else None
    return {
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "params": params,
        "ref": reference,
    }


def _gpt_reference(model: nn.Module) -> list[float]:
    """One process in fp16 with the same scaler, skipping the same step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=GROWTH)
    losses = []
    for step, (x, y) in enumerate(torch.utils.data.DataLoader(_gpt_data(), PER_RANK)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, y)[1]
        assert loss is not None
        scaler.scale(loss).backward()
        if step == POISONED:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses


GPT_RTOL = 2e-3
"""The tensor-parallel GPT's loss comes back in fp16 (rounded to 2**-11 ~ 4.9e-4 relative) and
its split matmuls round fp16 partial sums apart from one process's: measured 4.2e-4 relative at
most on these losses; 4 fp16 units of margin."""


def test_fp16_tensor_parallel_agrees_on_one_shards_overflow() -> None:
    ranks = run_distributed(_gpt_job, 1, world_size=2, timeout=90)
    for got in ranks:
        assert got["scales"] == [SCALE, SCALE / 2, SCALE / 2, SCALE]
        assert got["skipped"] == [step == POISONED for step in range(STEPS)]
        assert got["losses"] == pytest.approx(got["ref"], rel=GPT_RTOL)
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_fp16_dp_by_tp_mesh_agrees_on_one_shards_overflow() -> None:
    # dp=2 x tp=2: rank 1's inf reaches rank 3 (its data-parallel peer) through DDP's
    # all-reduce, never ranks 0 and 2 (the other tensor shard): they skip because they agree.
    ranks = run_distributed(_gpt_job, 2, world_size=4, timeout=120)
    for got in ranks:
        assert got["scales"] == [SCALE, SCALE / 2, SCALE / 2, SCALE]
        assert got["skipped"] == [step == POISONED for step in range(STEPS)]
    for a, b in ((0, 2), (1, 3)):  # data-parallel replicas of one tensor shard stay identical
        assert all(
            torch.equal(p, q) for p, q in zip(ranks[a]["params"], ranks[b]["params"], strict=True)
        )
