"""Every constructor argument of torch 2.13's DDP, accepted with torch's meaning.

One 2-rank job exercises each argument; each check compares with what the argument means:
gradients averaged by hand without DDP (``test_ddp_dropin._reference``), what was synchronised,
which collectives ran, which warnings torch gives.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import phalanx
from phalanx.testing import run_distributed
from tests.distributed.test_ddp_dropin import _assert_close, _grads, _inputs, _reference

DDP = phalanx.DistributedDataParallel


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)
        self.spare = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _net() -> nn.Module:
    torch.manual_seed(dist.get_rank())  # different on purpose: wrapping takes rank 0's
    return _Net()


def _step(ddp: nn.Module, model: nn.Module, fp32: bool = False) -> tuple[Any, Any]:
    x = _inputs(dist.get_rank(), 6, 4)
    want = _reference(model, lambda m: (m.float() if fp32 else m)(x).sum().backward())
    ddp(x).sum().backward()
    return _grads(model), want


def _buffers(model: nn.Module) -> list[float]:
    return [float(model.bn.running_mean.sum()), float(model.fc1.weight.sum())]


def _bucket_caps() -> dict[str, Any]:
    listed = DDP(_net(), bucket_cap_mb_list=[0.0001, 1], find_unused_parameters=True)
    default = DDP(_net(), find_unused_parameters=True)
    return {
        "listed": len(listed.reducer.buckets),
        "default": len(default.reducer.buckets),
        "cap": listed.bucket_bytes_cap,
        "grads": _step(listed, listed.module),
    }


def _batched_copy() -> list[Any]:
    out = []
    for kw in ({}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 1e-3}):
        ddp = DDP(_net(), find_unused_parameters=True, batched_grad_copy=True, **kw)
        for _ in range(2):  # the second step writes into the existing (zeroed) gradients
            out.append(_step(ddp, ddp.module))
            ddp.module.zero_grad(set_to_none=False)
    return out


def _buffer_flags() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, kw in {
        "default": {},
        "broadcast_false": {"broadcast_buffers": False},
        "forward_false": {"forward_sync_buffers": False},
        "no_init_sync": {"init_sync": False},
    }.items():
        model = _net()
        model.bn.running_mean.fill_(dist.get_rank())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(model, find_unused_parameters=True, **kw)
        at_init = _buffers(model)
        model.bn.running_mean.fill_(10 + dist.get_rank())
        ddp(_inputs(dist.get_rank(), 6, 4)).sum().backward()
        model.bn.running_mean.fill_(20 + dist.get_rank())
        model.eval()  # so the forward itself leaves the running mean alone
        ddp(_inputs(dist.get_rank(), 6, 4))  # syncs (or not) before this forward
        warned = [w.category.__name__ for w in caught]
        out[label] = (at_init, float(model.bn.running_mean.mean()), warned)
    return out


def _check_reduction() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(_net(), check_reduction=True, find_unused_parameters=True)
    return [w.category.__name__ for w in caught]


def _delayed() -> Any:
    model = _net()
    delayed = [("fc1.weight", model.fc1.weight), ("fc1.bias", model.fc1.bias)]
    ddp = DDP(
        model,
        delay_all_reduce_named_params=delayed,
        param_to_hook_all_reduce=model.fc1.weight,
        find_unused_parameters=True,
    )
    clone = copy.deepcopy(ddp)  # the delayed all-reduce survives pickling
    return [_step(ddp, model), _step(clone, clone.module)], ddp.parameters_to_ignore


def _mixed_precision() -> dict[str, Any]:
    model = _net()
    seen: list[torch.dtype] = []
    model.fc2.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    mp = _MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
    )
    ddp = DDP(model, mixed_precision=mp, find_unused_parameters=True)
    grads, want = _step(ddp, model, fp32=True)
    return {
        "grads": (grads, want),
        "forward_dtype": seen,
        "after": {p.dtype for p in model.parameters()}
        | {p.grad.dtype for p in model.parameters() if p.grad is not None},
        "buffer": model.bn.running_mean.dtype,
    }


def _device_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ddp = DDP(_net(), device_mesh=mesh, find_unused_parameters=True)
    return _step(ddp, ddp.module)


def _skip_unused() -> dict[str, Any]:
    ddp = DDP(
        _net(), find_unused_parameters=True, skip_all_reduce_unused_params=True, bucket_cap_mb=1e-6
    )
    phalanx.reset_comm_stats()
    grads = _step(ddp, ddp.module)
    names = ddp.reducer.names
    spare_only = [
        all(names[j].startswith("spare") for j in b.plan.params) for b in ddp.reducer.buckets
    ]
    return {
        "grads": grads,
        "calls": phalanx.comm_stats()["all_reduce"][0],
        "buckets": len(spare_only),
        "spare_only": sum(spare_only),
        "spare": ddp.module.spare.weight.grad,
    }


def _ignored() -> Any:
    model = _net()
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, ["spare.weight", "spare.bias", "fc2.bias"]
    )
    ddp = DDP(model, find_unused_parameters=False)
    x = _inputs(dist.get_rank(), 6, 4)
    (ddp(x) * x[:, :2]).sum().backward()
    local = model.fc2.bias.grad.clone()  # not averaged: it is ignored
    return local, x[:, :2].sum(0)


def _run_all() -> dict[str, Any]:
    behaviours: dict[str, Callable[[], Any]] = {
        "caps": _bucket_caps,
        "batched": _batched_copy,
        "buffers": _buffer_flags,
        "check_reduction": _check_reduction,
        "delayed": _delayed,
        "mixed_precision": _mixed_precision,
        "mesh": _device_mesh,
        "skip_unused": _skip_unused,
        "ignored": _ignored,
    }
    out = {}
    for name, fn in behaviours.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run_all, timeout=120)


def _get(results: list[dict[str, Any]], name: str) -> list[Any]:
    for r in results:
        value = r[name]
        assert not (isinstance(value, tuple) and value[:1] == ("error",)), value[1]
    return [r[name] for r in results]


def test_bucket_cap_mb_list_gives_each_bucket_its_cap(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "caps"):
        assert r["listed"] > r["default"] == 1  # tiny first cap splits off the last layer
        assert r["cap"] == 1024 * 1024
        _assert_close(*r["grads"])


def test_batched_grad_copy_averages_the_same(results: list[dict[str, Any]]) -> None:
    for per_rank in _get(results, "batched"):
        for grads in per_rank:
            _assert_close(*grads)


def test_buffer_sync_flags_follow_torch(results: list[dict[str, Any]]) -> None:
    per_rank = _get(results, "buffers")
    for rank, r in enumerate(per_rank):
        init, forward, warned = r["default"]
        assert init[0] == 0 and forward == 20 and warned == []  # rank 0's, at init and in forward
        init, forward, warned = r["broadcast_false"]
        assert init[0] == 8 * rank and forward == 20 + rank and "FutureWarning" in warned
        init, forward, warned = r["forward_false"]
        assert init[0] == 0 and forward == 20 + rank and warned == []
        init, forward, warned = r["no_init_sync"]
        assert init[0] == 8 * rank and forward == 20
    assert per_rank[0]["no_init_sync"][0][1] != per_rank[1]["no_init_sync"][0][1]  # params too


def test_check_reduction_is_a_deprecated_no_op(results: list[dict[str, Any]]) -> None:
    for warned in _get(results, "check_reduction"):
        assert "FutureWarning" in warned


def test_delayed_all_reduce_averages_before_the_optimizer_reads(
    results: list[dict[str, Any]],
) -> None:
    for steps, ignored in _get(results, "delayed"):
        assert {"fc1.weight", "fc1.bias"} <= ignored
        for grads in steps:
            _assert_close(*grads)


def test_mixed_precision_computes_low_and_steps_full(results: list[dict[str, Any]]) -> None:
    for r in _get(results, "mixed_precision"):
        assert r["forward_dtype"][-1] == torch.bfloat16  # DDP's forward (the first: reference)
        assert r["after"] == {torch.float32} and r["buffer"] == torch.bfloat16
        grads, want = r["grads"]
        for name in grads:  # bf16 forward/backward: within bf16 rounding of the fp32 average
            torch.testing.assert_close(grads[name], want[name], rtol=3e-2, atol=3e-2)
        assert any(not torch.equal(grads[n], want[n]) for n in grads)  # really low precision


def test_one_dimensional_device_mesh_is_the_group(results: list[dict[str, Any]]) -> None:
    for grads in _get(results, "mesh"):
        _assert_close(*grads)


def test_skip_all_reduce_unused_params_skips_usage_and_unused_buckets(
    results: list[dict[str, Any]],
) -> None:
    for r in _get(results, "skip_unused"):
        _assert_close(*r["grads"])
        assert r["spare"] is None
        assert r["spare_only"] >= 1
        assert r["calls"] == r["buckets"] - r["spare_only"]  # no usage map, no unused bucket


def test_ignored_parameters_keep_local_gradients(results: list[dict[str, Any]]) -> None:
    for local, own in _get(results, "ignored"):
        torch.testing.assert_close(local, own)  # this rank's gradient, not the average
