"""Strategies whose ranks each keep a piece of the model they built themselves start every rank
from rank 0's build, with ``Job()`` seeding nothing and each rank building from another seed
(as an unseeded program does): ``TorchFSDP``, ``Mesh(tp=2)`` and ``PS`` with two servers.

Without the broadcast each would train a patchwork of the ranks' builds, and every check below
would fail: rank 1's shard of each parameter would come from its own draw.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _fsdp() -> list[bool]:
    torch.set_num_threads(1)
    job = phalanx.Job(phalanx.TorchFSDP())
    model = _mlp(100 + job.world.rank)  # a different build on every rank
    model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    from torch.distributed.tensor import DTensor

    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    same = [torch.equal(p.detach(), q) for p, q in zip(whole, _mlp(100).parameters(), strict=True)]
    job.close()
    return same


def test_torch_fsdp_starts_from_rank0s_build() -> None:
    for same in run_distributed(_fsdp, world_size=2, timeout=60):
        assert same and all(same)


def _gpt_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 65, (2, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 65, x.shape, generator=g))


def _tensor_parallel() -> tuple[float, float]:
    torch.set_num_threads(1)
    job = phalanx.Job(phalanx.Mesh(tp=2))
    torch.manual_seed(100 + job.world.rank)  # a different build on every rank
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    torch.manual_seed(100)
    rank0s = GPT(GPTConfig(65, 16, 2, 4, 32))
    job.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _gpt_data().tensors
    loss = float(job.forward_backward(x, y))
    want = rank0s(x, y)[1]
    assert want is not None
    job.close()
    return loss, float(want.detach())


def test_tensor_parallel_starts_from_rank0s_build() -> None:
    for loss, want in run_distributed(_tensor_parallel, world_size=2, timeout=60):
        # fp32 reassociation of the split matmuls (as the tensor-parallel parity tests)
        assert abs(loss - want) <= 1e-5 * abs(want)


def _ps() -> dict[str, Any]:
    torch.set_num_threads(1)
    job = phalanx.Job(phalanx.PS(mode="sync", servers=2))
    model = _mlp(100 + job.world.rank)  # a different build on every rank
    start = copy.deepcopy(_mlp(100))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the final model is the initial one
    model, _ = job.setup(model, opt, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 6, generator=g), torch.randn(8, 2))
    for _ in job.epochs(1):
        for x, y in job.progress(job.loader(data, batch_size=4)):
            job.forward_backward(x, y)
            job.step()
    same = [torch.equal(p.detach(), q) for p, q in zip(model.parameters(), start.parameters())]
    server = job.is_server
    job.close()
    return {"server": server, "same": same}


def test_parameter_servers_start_from_rank0s_build() -> None:
    ranks = run_distributed(_ps, world_size=3, timeout=60)
    assert [r["server"] for r in ranks] == [True, True, False]
    worker = ranks[2]["same"]  # the worker pulled every server's shard
    assert worker and all(worker)
