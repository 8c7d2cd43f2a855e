"""DistributedOptimizer and broadcast_optimizer_state as Horovod has them, on 2 gloo ranks: the
dummy zero-gradient step of a fresh optimizer, the warning for step() after synchronize(), and
sparse gradients (all-gathered, or all-reduced densely with ``sparse_as_dense=True``).

Sparse parity: the reference applies the mean of both ranks' dense gradients in one process;
SGD on the summed sparse entries differs from it by float reassociation only (atol 1e-6).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import phalanx.horovod as hvd
from phalanx.testing import run_distributed


def _fresh_optimizer_state() -> dict[str, Any]:
    torch.manual_seed(hvd.rank())
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    state = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    bgrad = hvd.broadcast(model[1].weight.grad, root_rank=0)  # Horovod's test does this too
    return {"grads": grads, "state": state, "bgrad": bgrad}


def test_broadcast_optimizer_state_gives_a_fresh_optimizer_horovods_dummy_step() -> None:
    for result in run_distributed(_fresh_optimizer_state, world_size=2, timeout=60):
        grads = result["grads"]
        assert grads["0.bias"] is None, "a frozen parameter gets no gradient"
        for name in ("0.weight", "1.weight", "1.bias"):
            assert grads[name] is not None and not grads[name].any(), f"{name}: zero gradient"
        assert sorted(result["state"]) == [0, 2, 3]  # momentum for each trainable parameter
        assert all(not buf.any() for buf in result["state"].values())
        assert not result["bgrad"].any()


def _step_after_synchronize() -> list[int]:
    model = nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    counts = []
    for explicit, skip in ((True, False), (True, True), (False, False)):
        opt.zero_grad()
        model(torch.ones(3, 2)).sum().backward()
        if explicit:
            opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(w.message) for w in caught]
        assert all("skip_synchronize()" in t for t in texts), texts
        counts.append(len(texts))
    return counts


def test_step_after_synchronize_warns_once_unless_skipped() -> None:
    assert run_distributed(_step_after_synchronize, world_size=2, timeout=60) == [[1, 0, 0]] * 2


def _inputs(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4], [4, 3, 2]]) if rank == 0 else torch.tensor([[1, 3], [5, 5]])


def _embedding() -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(6, 3, sparse=True)


def _sparse_training(sparse_as_dense: bool) -> dict[str, Any]:
    emb = _embedding()
    base = torch.optim.SparseAdam if sparse_as_dense else torch.optim.SGD
    opt = hvd.DistributedOptimizer(
        base(list(emb.parameters()), lr=1.0),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=sparse_as_dense,
    )
    for _ in range(2):
        opt.zero_grad()
        (emb(_inputs(hvd.rank())) * torch.arange(3.0)).sum().backward()
        assert emb.weight.grad is not None and emb.weight.grad.is_sparse, "local: sparse"
        opt.synchronize()
        grad = emb.weight.grad
        assert grad is not None and grad.is_sparse, "after synchronize: still sparse"
        with opt.skip_synchronize():
            opt.step()
    return {"weight": emb.weight.detach().clone(), "grad": grad.to_dense()}


def _reference_sgd() -> tuple[torch.Tensor, torch.Tensor]:
    emb = nn.Embedding(6, 3)
    emb.load_state_dict(_embedding().state_dict())
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    for _ in range(2):
        opt.zero_grad()
        for rank in range(2):
            ((emb(_inputs(rank)) * torch.arange(3.0)).sum() / 2).backward()
        opt.step()
    return emb.weight.detach(), emb.weight.grad


def test_sparse_gradients_are_all_gathered_like_horovod() -> None:
    a, b = run_distributed(_sparse_training, False, world_size=2, timeout=60)
    weight, grad = _reference_sgd()
    for got in (a, b):
        torch.testing.assert_close(got["grad"], grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["weight"], weight, rtol=0, atol=1e-6)
    a, b = run_distributed(_sparse_training, True, world_size=2, timeout=60)
    assert torch.equal(a["weight"], b["weight"]), "SparseAdam replicas must stay identical"
    torch.testing.assert_close(a["grad"], grad, rtol=0, atol=1e-6)


def _backward_beside_another_operation() -> str:
    model = nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert opt is not None
    try:
        if hvd.rank() == 0:
            model(torch.ones(3, 4)).sum().backward()
        else:
            hvd.allreduce(torch.ones(3))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_backward_pass_beside_another_operation_raises_on_both_ranks() -> None:
    for message in run_distributed(_backward_beside_another_operation, world_size=2, timeout=60):
        assert "rank 0 is in a backward pass of DistributedOptimizer #0" in message, message
        assert "rank 1 is in allreduce #0 (unnamed)" in message, message
