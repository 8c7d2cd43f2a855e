"""phalanx's DDP behaves as torch's where torch's own tests found it did not.

Each behaviour runs once on 2 gloo ranks (one module-scoped job); every check compares with a
reference computed on the same ranks without DDP: each rank's local gradient, averaged by an
explicit all-reduce. Tolerance: the averages differ only by the order of the sum (1e-6).
"""

from __future__ import annotations

import copy
import io
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.checkpoint import checkpoint

import phalanx
from phalanx.testing import run_distributed

DDP = phalanx.DistributedDataParallel


def _inputs(rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def _mean(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _reference(model: nn.Module, run: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    """Gradients of ``run`` on a plain copy of the (already synced) model, averaged by hand
    (a parameter without a gradient counts as zeros, as in DDP's reduction)."""
    plain = copy.deepcopy(model)
    run(plain)
    return {
        n: _mean(p.grad.to_dense() if p.grad is not None else torch.zeros_like(p))
        for n, p in plain.named_parameters()
    }


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}


def _pickled_ddp_still_averages() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ddp = DDP(nn.Linear(4, 2))
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    x = _inputs(rank, 3, 4)
    out = {}
    for label, model in (
        ("loaded", torch.load(buf, weights_only=False)),
        ("deepcopy", copy.deepcopy(ddp)),
    ):
        want = _reference(model.module, lambda m: m(x).sum().backward())
        model(x).sum().backward()
        out[label] = (_grads(model.module), want)
    return out


def _create_graph() -> dict[str, Any]:
    rank = dist.get_rank()
    model = nn.Linear(3, 1, bias=False)
    ddp = DDP(model)
    x = _inputs(rank, 2, 3)
    want = _reference(model, lambda m: m(x).pow(2).sum().backward())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp(x).pow(2).sum().backward(create_graph=True)
    return {
        "grads": (_grads(model), want),
        "grad_has_graph": model.weight.grad.requires_grad,
        "warned": any("create_graph" in str(w.message) for w in caught),
    }


class _Conditional(nn.Module):
    """torch's test model: each rank uses a different layer in each of two micro-steps."""

    def __init__(self) -> None:
        super().__init__()
        self.nn = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
        self.state = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = 2 * dist.get_rank() + self.state
        self.state = 1 - self.state
        return self.nn[layer](x)


def _no_sync_with_unused() -> dict[str, Any]:
    rank = dist.get_rank()
    model = _Conditional()
    ddp = DDP(model, find_unused_parameters=True)
    xs = [_inputs(10 * rank + i, 4, 1) for i in range(2)]

    def run(m: nn.Module) -> None:
        for x in xs:
            m(x).sum().backward()

    want = _reference(model, run)
    with ddp.no_sync():
        ddp(xs[0]).sum().backward()
    ddp(xs[1]).sum().backward()
    return {
        "grads": (_grads(model), want),
        "none": [n for n, p in model.named_parameters() if p.grad is None],
    }


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(idx, offsets))


def _sparse(**kwargs: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = _Bag()
    hook = kwargs.pop("hook", None)
    ddp = DDP(model, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(dist.group.WORLD, hook)
    idx = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(rank))
    offsets = torch.tensor([0, 4])
    want = _reference(model, lambda m: m(idx, offsets).sum().backward())
    for _ in range(2):  # the second iteration checks the state was reset
        model.zero_grad()
        ddp(idx, offsets).sum().backward()
    return {"grads": (_grads(model), want), "sparse": model.bag.weight.grad.is_sparse}


def _errors() -> dict[str, Any]:
    out = {}
    for label, build in {
        "no_params": lambda: DDP(nn.Module()),
        "frozen": lambda: DDP(nn.Linear(2, 2).requires_grad_(False)),
        "device_ids_cpu": lambda: DDP(
            nn.Linear(2, 2), device_ids=[dist.get_rank()], output_device=dist.get_rank()
        ),
        "two_ids": lambda: DDP(nn.Linear(2, 2), device_ids=[0, 1]),
        "cap": lambda: DDP(nn.Linear(2, 2), bucket_cap_mb=-1),
        "delay_half": lambda: DDP(nn.Linear(2, 2), delay_all_reduce_named_params=[]),
    }.items():
        try:
            build()
            out[label] = ("no error", "")
        except Exception as exc:
            out[label] = (type(exc).__name__, str(exc))
    return out


class _Checkpointed(nn.Module):
    """A block run twice under a reentrant checkpoint: its hooks fire twice per backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = checkpoint(self.block, x, use_reentrant=True)
        return self.head(x)


def _static_graph() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Checkpointed()
    ddp = DDP(model, static_graph=True)
    out = {}
    for step in range(3):
        x = _inputs(10 * rank + step, 2, 4).requires_grad_()
        want = _reference(model, lambda m, x=x: m(x).sum().backward())
        model.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        out[step] = (_grads(model), want, model.never.weight.grad)
    dynamic = DDP(_Checkpointed(), find_unused_parameters=True)
    try:
        dynamic(_inputs(rank, 2, 4).requires_grad_()).sum().backward()
        out["dynamic"] = ""
    except RuntimeError as exc:
        out["dynamic"] = str(exc)
    return out


def _run_all() -> dict[str, Any]:
    behaviours: dict[str, Callable[[], Any]] = {
        "pickle": _pickled_ddp_still_averages,
        "create_graph": _create_graph,
        "no_sync_unused": _no_sync_with_unused,
        "sparse": _sparse,
        "sparse_view": lambda: _sparse(gradient_as_bucket_view=True),
        "sparse_hook": lambda: _sparse(hook=allreduce_hook),
        "errors": _errors,
        "static_graph": _static_graph,
    }
    out = {}
    for name, fn in behaviours.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run_all, timeout=120)


def _check(results: list[dict[str, Any]], name: str) -> list[Any]:
    for r in results:
        assert "error" not in r[name] if isinstance(r[name], dict) else True, r[name].get("error")
    return [r[name] for r in results]


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal averages; a parameter DDP left without a gradient must be unused everywhere."""
    for n in want:
        if n not in got:
            assert not want[n].any(), f"{n} has no gradient but was used on some rank"
            continue
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-6, msg=n)


def test_torch_save_and_deepcopy_keep_averaging(results: list[dict[str, Any]]) -> None:
    for per_rank in _check(results, "pickle"):
        for got, want in per_rank.values():
            _assert_close(got, want)


def test_create_graph_averages_and_warns(results: list[dict[str, Any]]) -> None:
    for r in _check(results, "create_graph"):
        _assert_close(*r["grads"])
        assert r["grad_has_graph"] and r["warned"]


def test_no_sync_with_find_unused_averages_parameters_used_only_in_no_sync(
    results: list[dict[str, Any]],
) -> None:
    for r in _check(results, "no_sync_unused"):
        assert r["none"] == []
        _assert_close(*r["grads"])


@pytest.mark.parametrize("variant", ["sparse", "sparse_view", "sparse_hook"])
def test_sparse_gradients_are_averaged_and_stay_sparse(
    results: list[dict[str, Any]], variant: str
) -> None:
    for r in _check(results, variant):
        assert r["sparse"]
        _assert_close(*r["grads"])


def test_construction_errors_are_torchs(results: list[dict[str, Any]]) -> None:
    errors = _check(results, "errors")[0]
    assert (
        errors["no_params"][0] == "RuntimeError"
        and "doesn't have any parameter" in errors["no_params"][1]
    )
    assert errors["frozen"][0] == "RuntimeError"
    kind, msg = errors["device_ids_cpu"]
    assert kind == "ValueError" and "device_ids=[0]" in msg and "output_device=0" in msg
    assert errors["two_ids"][0] == "ValueError" and "device_ids=[0, 1]" in errors["two_ids"][1]
    assert (
        errors["cap"][0] == "ValueError"
        and "bucket_cap_mb" in errors["cap"][1]
        and "-1" in errors["cap"][1]
    )
    assert (
        errors["delay_half"][0] == "ValueError"
        and "param_to_hook_all_reduce" in errors["delay_half"][1]
    )


def test_static_graph_handles_reentrant_checkpoint_and_unused(
    results: list[dict[str, Any]],
) -> None:
    for r in _check(results, "static_graph"):
        for step in range(3):  # the first learns the graph, the others rely on it
            grads, want, never = r[step]
            _assert_close(grads, want)
            assert never is None, f"step {step}: a parameter unused everywhere got a gradient"
        assert "produced a gradient twice" in r["dynamic"] and "static_graph=True" in r["dynamic"]
