"""hvd.join() with uneven inputs: the joined rank shadows the others' gradient all-reduces."""

from __future__ import annotations

import time

import torch
from torch import nn

import phalanx.horovod as hvd
from phalanx.testing import run_distributed


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))


def _reference(world: int, steps: list[int]) -> list[torch.Tensor]:
    """One process: each step averages the gradients of the ranks that still have data."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(steps)):
        opt.zero_grad()
        for rank in range(world):
            if step < steps[rank]:
                x, y = _data(rank, step)
                (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _uneven(steps: list[int]) -> tuple[int, list[torch.Tensor], float]:
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    start = time.monotonic()
    for step in range(steps[hvd.rank()]):
        opt.zero_grad()
        x, y = _data(hvd.rank(), step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return last, [p.detach().clone() for p in model.parameters()], time.monotonic() - start


def test_join_shadows_uneven_ranks_and_matches_a_reference() -> None:
    steps = [3, 5, 4]
    results = run_distributed(_uneven, steps, world_size=3, timeout=90)
    assert {r[0] for r in results} == {1}  # every rank names the same last joiner
    ref = _reference(3, steps)
    for got, want in zip(results[1][1], ref):  # the rank that trained to the end
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert max(r[2] for r in results) < 30


def _joined_collectives(first: int) -> int:
    """Rank ``first`` joins at once; the other keeps calling collectives, then joins."""
    last = hvd.join() if hvd.rank() == first else _working(first)
    # unnamed operations match by call order: the joined rank counted the others' calls too
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), 2.0))
    return last


def _working(first: int) -> int:
    r = hvd.rank()
    x = torch.tensor([5, -3, 7])
    ops = {
        hvd.Sum: x,
        hvd.Average: torch.tensor([2, -1, 3]),
        hvd.Min: x,
        hvd.Max: x,
        hvd.Product: x,
    }
    for op, want in ops.items():  # the joined rank contributes the neutral value of each
        assert torch.equal(hvd.allreduce(x, op=op), want), f"op {op}"
    got = hvd.grouped_allreduce([x.double(), torch.ones(2, 2)], op=hvd.Sum)
    assert torch.equal(got[0], x.double()) and torch.equal(got[1], torch.ones(2, 2))
    handle = hvd.allreduce_async(x.float(), name="named", op=hvd.Min)
    assert torch.equal(hvd.synchronize(handle), x.float())
    hvd.barrier()
    for call in (
        lambda: hvd.allgather(x),
        lambda: hvd.broadcast(x, r),
        lambda: hvd.alltoall(torch.ones(2)),
        lambda: hvd.reducescatter(torch.ones(2)),
    ):
        try:  # as in Horovod: only all-reduces run while a rank has joined
            call()
        except RuntimeError as exc:
            assert f"rank(s) [{first}] are in join()" in str(exc), str(exc)
        else:
            raise AssertionError("a collective that join() cannot take part in did not raise")
    return hvd.join()


def test_joined_rank_takes_part_in_allreduces_with_neutral_values() -> None:
    for first in (0, 1):
        results = run_distributed(_joined_collectives, first, world_size=2, timeout=60)
        assert results == [1 - first] * 2  # every rank names the rank that joined last
