"""``backend="shm"`` over several hosts (``comm/shm/hierarchical.py``), hosts simulated on this
machine by ``PHALANX_SHM_HOST``: all_reduce goes through each host's shared memory and gloo
between the hosts' first ranks; every other call goes to gloo. Results equal gloo's (integers,
MIN / MAX exactly; float sums within rounding: they add within a host first)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.comm.shm.segment import HOST_ENV, SEGMENT_PREFIX, SHM_DIR
from phalanx.testing import run_distributed

RED = dist.ReduceOp


def _data(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _cases(hosts: list[str]) -> dict[str, Any]:
    """On a gloo world: an shm group whose ranks claim the ``hosts`` given, then every call on
    it against the same call on a gloo group."""
    rank = dist.get_rank()
    os.environ[HOST_ENV] = hosts[rank]
    shm = dist.new_group(backend="shm")
    gloo = dist.new_group(backend="gloo")
    kind = type(shm._get_backend(torch.device("cpu"))).__name__  # type: ignore[attr-defined]
    out: dict[str, Any] = {"kind": type(shm).__name__, "backend": kind, "bad": []}
    for dtype, op in [
        (torch.float32, RED.SUM),
        (torch.float32, RED.AVG),
        (torch.float64, RED.MAX),
        (torch.int64, RED.SUM),
        (torch.int32, RED.MIN),
        (torch.bfloat16, RED.SUM),
    ]:
        for n in (1, 7, 300_001):
            a, b = _data(rank, dtype, n), _data(rank, dtype, n)
            dist.all_reduce(a, op=op, group=shm)
            dist.all_reduce(b, op=op, group=gloo)
            exact = not dtype.is_floating_point or op == RED.MAX
            tol = 6e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 rounds each partial sum
            same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=tol, atol=tol)
            if not same:
                out["bad"].append(f"all_reduce {dtype} {op} {n}")
    t = torch.arange(6.0) * (rank + 1)
    gathered = torch.empty(6 * dist.get_world_size())
    dist.all_gather_into_tensor(gathered, t, group=shm)
    expected = torch.cat([torch.arange(6.0) * (r + 1) for r in range(dist.get_world_size())])
    out["all_gather"] = torch.equal(gathered, expected)
    root = torch.full((3,), float(rank))
    dist.broadcast(root, src=dist.get_world_size() - 1, group=shm)
    out["broadcast"] = root.tolist()
    dist.barrier(group=shm)
    out["ddp"] = _ddp_equal(shm, gloo)
    path = shm.local.segment_path  # type: ignore[attr-defined]  # this host's segment
    dist.destroy_process_group(shm)
    out["segment"] = (path.startswith(f"{SHM_DIR}/{SEGMENT_PREFIX}"), os.path.exists(path))
    return out


def _train(group: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = phalanx.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_equal(shm: Any, gloo: Any) -> bool:
    ours, theirs = _train(shm), _train(gloo)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a"]])
def test_an_shm_group_over_several_hosts_equals_gloo(hosts: list[str]) -> None:
    results = run_distributed(_cases, hosts, world_size=len(hosts), timeout=120)
    for rank, res in enumerate(results):
        assert res["kind"] == "HierarchicalProcessGroup", res["kind"]
        assert res["bad"] == [], (rank, res["bad"])
        assert res["all_gather"] and res["broadcast"] == [float(len(hosts) - 1)] * 3
        assert res["ddp"], rank
        assert res["segment"] == (True, False)  # its host's segment is gone from /dev/shm
